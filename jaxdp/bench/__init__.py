"""Benchmarks: the serving load client (`python -m jaxdp.bench`, `serving.py`), the offline engine and its
host loop (`python -m jaxdp.bench.engine`), the per-step exchange between nodes (`.multihost`), and dense
against sparse attention by context length (`.sparse`). Each prints a table and writes JSON."""
