# placeholder: estimate stage (filled by its owner)
