# placeholder: report stage (filled by its owner)
