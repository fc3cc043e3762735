"""Pairwise network checks: the plan, the probes over TCP, the faulty nodes they name."""
