"""Per-rank scheduling: requests, the page pool and prefix cache, the persistent batch, the controller that picks
a rank, and the `Scheduler` that plans each rank's next step (no JAX here)."""
