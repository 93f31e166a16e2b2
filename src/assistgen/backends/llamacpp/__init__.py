"""The llama.cpp backend: GGUF models on llama.cpp's CPU kernels through llama-cpp-python's low-level API.

`loading.load(spec, LlamaSettings(...))` gives a `model.LlamaModel` behind the seam of `backends.base`;
llama-cpp-python (the row-exact build of `native/assistgen-llama-cpp`) is an optional extra (`pip install
'assistgen[llamacpp]'`), imported only when a model is loaded here.
"""
