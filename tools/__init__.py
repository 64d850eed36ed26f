"""torchneuron's developer tools, run from the repository root (``python -m tools.<name>``); not
part of the installed package, so editing them never touches users' caches of compiled executables.

``coverage`` (the OpInfo sweep), ``hf_coverage`` (Hugging Face causal LMs; ``hf_configs``,
``hf_report``), ``upstream`` (PyTorch's own device-generic tests; ``upstream_results``,
``upstream_worker``, ``upstream_report``), ``cpu_dtypes`` (the table of
dtypes CPU's kernels refuse, package data of ``torchneuron.ops``), and ``sweep``: the resumable
results file and crash-surviving worker supervisor they share.
"""
