"""Training and evaluating the embedded default model: the skills data (`data`), the trainer
(`python -m jaxdp.training.train`) and the held-out evaluation (`python -m jaxdp.training.eval`)."""
