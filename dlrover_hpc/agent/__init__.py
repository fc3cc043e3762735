"""dlrover-run's runtime: joins the master, spawns and supervises workers, hosts the saver."""
