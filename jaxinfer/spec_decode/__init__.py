"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) and the verifying target
step; docs/spec_decode.md has the design."""
