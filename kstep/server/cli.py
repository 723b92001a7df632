"""`kstep serve`: load each model on its engine's torch thread and run the OpenAI-compatible app."""
import argparse
import os
from dataclasses import replace

from kstep.flags import add_command, add_device_flags, add_knob_flags, add_memory_flags, check_memory_flags, knobs_given


def add_serve(sub) -> None:
    serve = add_command(sub, "serve", "an OpenAI-compatible HTTP server with continuous batching")
    serve.add_argument("--model", action="append", default=None, metavar="[NAME=]MODEL[:KEY=VALUE,...]",
                       help="a model to serve (repeat for several, each with its own engine): a checkpoint "
                            "directory or bundled name; NAME is what clients send (default: MODEL); options "
                            "for this model alone: draft=, quantize=, tp=, any decoding default below (e.g. "
                            "default-ar:draft=ngram, default:exact=true). Default: default")
    serve.add_argument("--served-model-name", default=None,
                       help="the `model` clients send, with one --model (default: --model)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless told otherwise)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("KSTEP_API_KEY"),
                       help="require 'Authorization: Bearer KEY' (default: $KSTEP_API_KEY, else none)")
    serve.add_argument("--max-batch-size", "--max-num-seqs", dest="max_batch_size", type=int, default=16,
                       help="requests per forward pass (at most; the KV pool's free pages may admit fewer)")
    serve.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                       help="tokens per engine step: a request joins when its steps fit beside the running ones' "
                            "(a diffusion canvas counts whole), and a longer AR prompt is prefilled in chunks of N, "
                            "one a step, adding at most one chunk's time to the other streams' steps; default 2048 "
                            "(on a CPU, 256 keeps streams smooth)")
    serve.add_argument("--long-prefill-token-threshold", type=int, default=None, metavar="N",
                       help="a prompt's chunk: at most N of its tokens a step (default: --max-num-batched-tokens), "
                            "so a step budget larger than the chunk runs more streams beside a long prompt")
    serve.add_argument("--max-queue", type=int, default=256, help="waiting requests before 429")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    serve.add_argument("--default-max-tokens", type=int, default=256, help="chat max_tokens when not given")
    serve.add_argument("--prefix-cache-mib", type=int, default=256,
                       help="prefix cache budget per model in MiB (0 turns it off; AR and block-diffusion models)")
    serve.add_argument("--graceful-timeout", type=float, default=None,
                       help="on SIGTERM / Ctrl-C, seconds the running requests may still go on (new ones get "
                            "503) before every request in flight is ended with a 503; default 0: at once "
                            "(with --replicas: Ray Serve's drain, default 30)")
    serve.add_argument("--max-request-passes", type=int, default=None,
                       help="a request that has run this many forward passes ends with finish_reason 'length' "
                            "(usage names the limit); default 4 x each model's context; 0: no limit")
    serve.add_argument("--max-request-seconds", type=float, default=600.0,
                       help="the same for seconds in the batch (default 600, the openai client's own timeout; "
                            "0: no limit)")
    add_device_flags(serve, threads=True, parallel=True)
    add_memory_flags(serve)
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--replicas", type=int, default=None,
                       help="serve on Ray Serve with this many replicas (each its own engines; a local Ray "
                            "instance unless --ray-address); needs pip install -e .[ray]")
    serve.add_argument("--cpus-per-replica", type=float, default=1.0,
                       help="Ray CPUs per replica (its engines' torch threads default to this)")
    serve.add_argument("--ray-address", default=None,
                       help="join this Ray cluster (e.g. auto, or HOST:6379 from `ray start --head`)")
    serve.add_argument("--quantize", default=None, choices=["none", "int8", "int4"],
                       help="weight-only quantization of the linear layers at load time, every model (a "
                            "quantized GGUF file: its nearest kstep type unless given; none: its dequantized floats)")
    serve.add_argument("--draft", default=None,
                       help="speculative decoding for the AR models: a draft model or 'ngram' (no model)")
    defaults = serve.add_argument_group("decoding defaults for every model that takes them (a --model option "
                                        "overrides one for its model, a request's fields override both)")
    add_knob_flags(defaults, server_defaults=True)
    serve.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from kstep.params import GenerationParams
    from kstep.server.app import ServeConfig, build_app
    from kstep.server.shutdown import serve
    from kstep.server.loading import LoadOptions, check_specs, load_served_models
    from kstep.server.model_specs import parse_model_spec
    if args.prefix_cache_mib < 0:
        raise ValueError(f"--prefix-cache-mib {args.prefix_cache_mib} must be >= 0")
    for name in ("port", "max_batch_size", "max_num_batched_tokens", "max_queue", "max_body_bytes", "default_max_tokens"):
        if getattr(args, name) <= 0 or (name == "port" and args.port > 65535):
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} is out of range")
    if args.long_prefill_token_threshold is not None and args.long_prefill_token_threshold <= 0:
        raise ValueError(f"--long-prefill-token-threshold {args.long_prefill_token_threshold} must be > 0")
    for name in ("graceful_timeout", "max_request_passes", "max_request_seconds"):
        value = getattr(args, name)
        if value is not None and not 0 <= value < float("inf"):
            raise ValueError(f"--{name.replace('_', '-')} {value} must be a number >= 0")
    check_memory_flags(args)
    shared = knobs_given(args)
    GenerationParams(**shared)  # a bad default fails now, naming the flag's value
    specs = [parse_model_spec(text) for text in args.model or ["default"]]
    if args.served_model_name is not None:
        if len(specs) > 1:
            raise ValueError("--served-model-name names the one --model; with several, name each as NAME=MODEL")
        specs[0] = replace(specs[0], name=args.served_model_name)
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--model: two models are served as {next(n for n in names if names.count(n) > 1)!r}; "
                         "name them apart with NAME=MODEL")

    backend = args.distributed_executor_backend or ("ray" if args.replicas is not None else "mp")
    if args.replicas is not None and backend != "ray" and max(s.tensor_parallel_size or args.tensor_parallel_size
                                                              for s in specs) > 1:
        raise ValueError(f"--distributed-executor-backend {backend} with --replicas: a replica's ranks are Ray "
                         "actors in its placement group (ray)")
    options = LoadOptions(args.device, args.dtype, args.threads, args.draft, args.quantize, shared,
                          args.tensor_parallel_size, backend, args.kv_cache_memory, args.memory_utilization)
    config = ServeConfig(api_key=args.api_key, max_batch_size=args.max_batch_size,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         long_prefill_token_threshold=args.long_prefill_token_threshold, max_queue=args.max_queue,
                         max_body_bytes=args.max_body_bytes, default_max_tokens=args.default_max_tokens,
                         prefix_cache_bytes=args.prefix_cache_mib << 20, max_request_passes=args.max_request_passes,
                         max_request_seconds=args.max_request_seconds)
    if args.replicas is not None and (args.replicas <= 0 or args.cpus_per_replica <= 0):
        raise ValueError(f"--replicas {args.replicas} and --cpus-per-replica {args.cpus_per_replica} must be positive")
    check_specs(specs, options)  # every spec, before Ray starts, a model loads or a line is printed
    if args.replicas is not None:
        from kstep.server.replicas import ReplicaOptions, serve_replicas
        return serve_replicas(specs, options, config, ReplicaOptions(
            args.replicas, args.cpus_per_replica, args.ray_address, args.host, args.port,
            30.0 if args.graceful_timeout is None else args.graceful_timeout))
    served = load_served_models(specs, options, announce=f"on http://{args.host}:{args.port}/v1")
    return serve(build_app(served, config), args.host, args.port, args.log_level, args.graceful_timeout or 0.0)
