"""What a request gives back: its statistics (`stats`), its stream's events and final result (`events`), and the
plain-text tables they print as (`tables`)."""
