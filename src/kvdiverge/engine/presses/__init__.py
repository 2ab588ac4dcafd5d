"""The presses: one adapter per registry row, the registry, the press status table, kept-count
promises, policies (config entries and press objects) and the project's own presses."""
