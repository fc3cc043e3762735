"""The goodput report: analysis of a job's event log, its table and its timeline plot."""
