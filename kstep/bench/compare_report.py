"""`kstep bench compare`'s report: the latency-vs-N plot against the floors, and the markdown table
with the crossovers and the time breakdown of one generation per side."""
from pathlib import Path


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 5))
    colors = {"ar": "tab:blue", "diffusion exact": "tab:red", "diffusion dual+threshold": "tab:green",
              "diffusion dual K=N/4": "tab:purple"}
    here = result["predictions"]["here"]
    for name, floors in here["floor_seconds"].items():
        color = colors.get(name, "gray")
        points = [r for r in result["rows"] if r["side"] == name]
        ax.plot([r["n"] for r in points], [r["seconds"] for r in points], "o", color=color, label=f"{name}: measured")
        ax.plot(here["n"], floors, "-", color=color, alpha=0.5, label=f"{name}: floor (cost model)")
    for name, entry in result["crossover"].items():
        if entry["measured_n"] is not None:
            ax.axvline(entry["measured_n"], color=colors.get(name, "gray"), ls="--", lw=1,
                       label=f"crossover, {name}: N = {entry['measured_n']:.0f}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("output tokens N")
    ax.set_ylabel("latency, one request (s)")
    cal = result["calibration"]
    ax.set_title(f"Latency vs N on {cal['name']} ({cal['bandwidth_gb_s']:.0f} GB/s, "
                 f"{cal['matmul_tflops'] * 1000:.0f} GFLOP/s measured)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _span(lengths: list[int]) -> str:
    if not lengths:
        return "never (N <= 4096)"
    return f"N {lengths[0]}-{lengths[-1]}" if len(lengths) > 1 else f"N = {lengths[0]}"


def format_row(r: dict) -> str:
    return (f"| {r['side']} | {r['n']} | {r['seconds']:.3f} | {r['ttft_seconds']:.3f} | {r['nfe']:.1f} | "
            f"{r['tokens_per_pass']:.2f} | {r['tokens_per_s']:.1f} | {r['floor_seconds']:.4f} | "
            f"{r['measured_over_floor']:.1f} |")


def format_table(result: dict) -> str:
    lines = ["| side | N | latency s | TTFT s | passes | tokens/pass | tokens/s | floor s | measured/floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [format_row(r) for r in result["rows"]]
    lines.append("")
    for name, entry in sorted(result["crossover"].items()):
        measured = entry["measured_n"]
        text = f"N = {measured:.0f}" if measured is not None else f"none in {entry['measured_lengths']}"
        predicted = ", ".join(f"{result['predictions'][k[20:]]['device']}: {_span(v)}"
                              for k, v in entry.items() if k.startswith("predicted_faster_at_"))
        lines.append(f"{name} faster than ar: measured at N in {entry['measured_faster_at'] or 'none'} "
                     f"(first crossing {text}); floors predict {predicted}")
    lines.append("")
    for name, p in result["profiles"].items():
        shares = ", ".join(f"{k} {v:.0%}" for k, v in p.items() if k not in ("n", "wall_seconds"))
        lines.append(f"time of one N={p['n']} generation, {name}: {shares}")
    return "\n".join(lines)
