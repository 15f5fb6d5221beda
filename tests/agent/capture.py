"""For tests: a transport that keeps what the agent's collector sends instead of posting it, and a stand-in for the
statistics launches."""


class CaptureTransport:
    def __init__(self):
        self.tensors, self.scalars, self.meta = [], [], []

    def send_tensors(self, block):
        self.tensors.append(block)

    def send_scalars(self, block):
        self.scalars.append(block)

    def set_run_meta(self, **meta):
        self.meta.append(meta)

    def flush(self, timeout=None):
        return True

    def close(self, timeout=None):
        return True

    def records(self) -> dict:
        """(step, layer, site, rank) -> stats dict (with log2_hist); a duplicate fails."""
        out = {}
        for b in self.tensors:
            for i, (layer, site) in enumerate(zip(b["layer"], b["site"])):
                key = (b["step"], layer, site, b["rank"])
                assert key not in out, f"record {key} sent twice"
                rec = {name: col[i] for name, col in b["stats"].items()}
                rec["log2_hist"] = b["log2_hist"][i] if "log2_hist" in b else None
                out[key] = rec
        return out


def rows_counting(launches: list):
    """A torch stand-in for ``stats.launch.rows`` (as on a GPU) that records each launch's tensor count."""
    from fp8mon.agent.stats import torch_path as ds

    def rows(tensors, *, fmt, scale, center, outlier_k, amax_history_max, hist, out, index, merge, later=False):
        if later and any(s is not None for s in list(scale) + list(amax_history_max)):  # as the real one
            raise ValueError("rows(later=True) takes no scale and no amax_history_max")
        launches.append(len(tensors))
        for i, x in enumerate(tensors):
            row = ds.partials(x, fmt=fmt[i], scale=scale[i], amax_history_max=amax_history_max[i],
                              outlier_k=outlier_k, hist=hist)
            out[index[i]] = ds.merge(out[index[i]], row) if merge[i] else row

    return rows
