"""`decoding="auto"`'s brain: the calibrated step-time model (`costmodel`), the controller choosing plain steps or a
drafter and draft length per sequence (`controller`), and `specmoe plan`'s predictions (`profiles`)."""
