"""Worker links: how the backbone reaches an expert holder (TCP, in-process; TLS or a relay later)."""

FANOUTS = ("star", "chain")  # send every share before awaiting any reply, or one after another
