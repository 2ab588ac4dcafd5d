# placeholder: analyse stage (filled by its owner)
