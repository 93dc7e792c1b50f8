"""Prefill/decode disaggregation: a prefill engine and a decode engine on separate device groups,
each request's KV blocks moved from one to the other (docs/disaggregation.md). Here: the role flags
and meshes, the KV transfer; the front end is jaxinfer/frontends/disaggregated.py."""
