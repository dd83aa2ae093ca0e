"""Generation over a backbone (remote experts) with optional local check and speculation."""
