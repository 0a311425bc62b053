"""Expert-parallel load balancing (EPLB): DeepSeek's placement algorithm (`jaxdp.eplb.algorithm`) and the expert
placement as data (`jaxdp.eplb.placement`), and the EP step's redundant expert slots with the map as its input
(`jaxdp.eplb.slots`), the expert-distribution recorder (`jaxdp.eplb.recorder`) and online rebalancing
(`jaxdp.eplb.online`, on one node or several); `python -m jaxdp.eplb --demo` prints balancedness before and after on
skewed synthetic loads, `python -m jaxdp.eplb.dispatch` static against dynamic dispatch (`--ep-dispatch-algorithm`).
What is built and what is not: docs/eplb.md."""
