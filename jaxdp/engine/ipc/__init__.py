"""The process boundary: the `EngineClient` interface, the typed messages and their codec, request updates and
streams, and the engine process with the server's stand-in for it."""
