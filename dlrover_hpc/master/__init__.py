"""master."""
