"""What a generation is made of: sampling, stops, drafts and branches, the local check, its request and report."""
