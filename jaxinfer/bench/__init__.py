"""`jaxinfer bench`: benchmark drivers installed with the package (cli.py lists them), the vLLM-
shaped result files they write, and the project's own records (results_io.py)."""
