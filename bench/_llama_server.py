"""llama.cpp's server (``llama-cpp-python[server]``) on 127.0.0.1, for bench_serve.py only.

``python bench/_llama_server.py MODEL.gguf PORT THREADS [--no-mlock]`` runs
llama-cpp-python's own FastAPI app under uvicorn, exactly as ``python -m
llama_cpp.server`` does, with two changes: the model is loaded with
``use_extra_bufts=False`` (``_llama.without_extra_bufts``, as every bench loads
llama.cpp: this machine's build crashes in its AMX buffers otherwise), and a new
request waits for the running one instead of interrupting it
(``interrupt_requests=False``). ``--no-mlock``: the model's pages are not locked in
memory (llama-cpp-python's server locks them by default, llama.cpp's own
``llama-server`` does not; locked pages cannot be reclaimed, so under a memory cap
smaller than the model the locked server is killed as it loads). Loopback only; the
bench stops it.
"""

from __future__ import annotations

import sys


def main() -> int:
    path, port, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    mlock = "--no-mlock" not in sys.argv[4:]
    import uvicorn
    from _llama import without_extra_bufts
    from llama_cpp.server.app import create_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    with without_extra_bufts():  # the model loads as the app is made
        app = create_app(
            # Queue concurrent requests (its default lets a new request cut off the running
            # stream, which would not be the same load).
            server_settings=ServerSettings(host="127.0.0.1", port=port, interrupt_requests=False),
            model_settings=[
                ModelSettings(
                    model=path,
                    model_alias="llama",
                    n_ctx=2048,
                    n_batch=512,
                    n_threads=threads,
                    n_threads_batch=threads,
                    logits_all=False,
                    use_mlock=mlock and ModelSettings.model_fields["use_mlock"].default,
                    verbose=False,
                )
            ],
        )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
