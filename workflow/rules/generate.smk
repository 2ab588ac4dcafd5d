# placeholder: generate stage (filled by its owner)
