"""jaxfp8's tooling: the command line (`python -m jaxfp8`, `cli`), benchmarks (`bench` over `bench_gemm`,
`bench_linear`, `bench_quant`; `tp`), the Triton GEMM tuner (`tune`), plots (`plot`), CUPTI kernel timing (`timing`)
and the baselines the benchmarks time (`baselines`). Not part of the library users import: `import jaxfp8` loads
none of it.
"""
