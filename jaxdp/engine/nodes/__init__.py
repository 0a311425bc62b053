"""Several nodes: the distributed runtime and the per-step exchange (`hosts`), the `Nodes` interface the loop
talks to (`link`), and the supervision of a node's process."""
