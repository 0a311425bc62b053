"""The step pipeline and its step kinds: buckets, device sampling, speculative verify, prompt logprobs, the
disaggregated sides, and what each step measured."""
