"""Generated DRA (v1, v1beta1) and plugin-registration stubs. Produced by scripts/gen_dra.py from dra/*.proto; never edit."""
