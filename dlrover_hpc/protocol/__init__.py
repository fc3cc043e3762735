"""The agent <-> master wire: authenticated frames, typed messages, the client."""
