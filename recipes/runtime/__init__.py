"""What every entry point of recipes/ shares: argument checks and one-line errors, the model built one
way, data readers, checkpoints and their guarantees, the save lock, the watchdog, the dashboards."""
