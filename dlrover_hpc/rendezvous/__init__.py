"""Rendezvous: when a round is complete, and the nodes' rank order."""
