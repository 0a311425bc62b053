"""Prefill and decode on separate servers (the article's section 8.2, SGLang's `--disaggregation-mode`).

A prefill server reads prompts and hands each request's finished KV to a decode server, which never runs a
prompt step for it. The pieces: `kv` (a request's KV out of one page pool and into another, whatever the two
servers' page sizes and layouts), `transfer` (the KV through an existing library: JAX's transfer server),
`bootstrap` (the prefill server's endpoint where a decode server learns the model, the KV format and when a
request's KV is ready).
"""
