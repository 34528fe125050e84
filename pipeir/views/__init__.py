"""Terminal views of schedules (text only; pictures live with the simulator)."""
