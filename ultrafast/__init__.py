"""ultrafast: an LLM inference server. Importing the package first sets how long the kernel
libraries' idle OpenMP threads spin (omp_env.py): libgomp reads it once, when llama.cpp or
torch loads it, so it must come before any of them."""

from ultrafast import omp_env

omp_env.apply()
