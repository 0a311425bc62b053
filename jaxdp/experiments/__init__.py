"""The article's experiments as commands: `python -m jaxdp.experiments NAME [--quick] [--output-dir D] [server
flags]`. Each experiment starts its own servers on 127.0.0.1, drives them with `jaxdp.bench` and writes
`D/NAME.json`, `D/NAME.png` and `D/NAME.md` (the article's figures beside jaxdp's). See docs/experiments.md."""
