"""The layout planner: weights, KV and collectives per device for real model sizes (`python -m jaxdp.plan`).

plan.py builds the plan and holds the command line, report.py prints and draws it, weights.py counts
bytes per device, roofline.py times one decode step, gpus.py holds the GPU presets, compile.py checks a
plan against XLA's compile of the engine's steps on abstract weights (`--compile`).
"""
