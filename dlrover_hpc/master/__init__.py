"""The job master: node table, phases, decisions, their executor, the TCP server."""
