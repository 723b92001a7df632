"""One llama.cpp run on token ids, in a process of its own and without torch: greedy, batch 1, through
llama-cpp-python's ctypes bindings over the libllama that scripts/build_llamacpp.sh built (the
bench sets PYTHONPATH and LLAMA_CPP_LIB_PATH). A warm-up generation, then `repeats` timed ones,
each from an empty cache: the prompt in one llama_decode (prompt processing), then one llama_decode
per generated token, each token the argmax (llama.cpp's greedy sampler) and never stopped at an end
token, so the ids can be compared with kstep's `ignore_eos` greedy run.

    python worker.py '{"gguf": PATH, "prompt": [ids], "max_tokens": N, "threads": T, "repeats": R}'

prints one JSON line: {"ids": [...], "prompt_seconds": [...], "decode_seconds": [...]}."""
import ctypes
import json
import sys
import time


def main() -> int:
    job = json.loads(sys.argv[1])
    import llama_cpp.llama_cpp as L

    @L.llama_log_callback
    def quiet(level, text, user_data):  # llama.cpp logs every tensor at load: keep stdout for the result
        return None
    L.llama_log_set(quiet, ctypes.c_void_p(0))
    L.llama_backend_init()
    model = L.llama_model_load_from_file(job["gguf"].encode(), L.llama_model_default_params())
    if not model:
        print(json.dumps({"error": f"llama.cpp could not load {job['gguf']}"}))
        return 1
    prompt, n = job["prompt"], job["max_tokens"]
    params = L.llama_context_default_params()
    params.n_ctx = len(prompt) + n + 8
    params.n_batch = params.n_ubatch = max(len(prompt), 1)
    params.n_threads = params.n_threads_batch = job["threads"]
    ctx = L.llama_init_from_model(model, params)
    sampler = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    L.llama_sampler_chain_add(sampler, L.llama_sampler_init_greedy())

    def generate() -> tuple[list[int], float, float]:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        ids = (L.llama_token * len(prompt))(*prompt)
        start = time.perf_counter()
        if L.llama_decode(ctx, L.llama_batch_get_one(ids, len(prompt))) != 0:
            raise RuntimeError("llama_decode failed on the prompt")
        token = L.llama_sampler_sample(sampler, ctx, -1)
        prompt_seconds = time.perf_counter() - start
        out, one = [token], (L.llama_token * 1)()
        start = time.perf_counter()
        for _ in range(n - 1):
            one[0] = token
            if L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) != 0:
                raise RuntimeError("llama_decode failed on a decode step")
            token = L.llama_sampler_sample(sampler, ctx, -1)
            out.append(token)
        return out, prompt_seconds, time.perf_counter() - start

    generate()  # warm-up: first-call costs (page-ins of the mapped weights, buffers)
    runs = [generate() for _ in range(job["repeats"])]
    print(json.dumps({"ids": runs[-1][0], "prompt_seconds": [r[1] for r in runs],
                      "decode_seconds": [r[2] for r in runs]}))
    L.llama_sampler_free(sampler)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
