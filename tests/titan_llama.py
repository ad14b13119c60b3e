"""torchtitan's llama3 written out small for ``test_dcp.py``: a plain torch model with
its module names and its rotary pairing, built by the tests and by the 2-rank FSDP2
worker they start (so this file imports neither pytest nor MPI)."""

import torch


class TitanLlama(torch.nn.Module):
    """torchtitan's llama3 written out small, by its module names: rotary embedding on
    interleaved channel pairs (complex numbers), grouped-query attention, SwiGLU
    ``w2(silu(w1 x) * w3 x)``, RMSNorm. Only a model with these names and this pairing
    gives our logits from our export."""

    def __init__(self, cfg):
        super().__init__()
        nn, C, hs = torch.nn, cfg.n_embd, cfg.head_size
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, C)
        self.layers = nn.ModuleDict()
        for i in range(cfg.n_layer):
            layer = nn.Module()
            layer.attention = nn.Module()
            for name, rows in (("wq", cfg.n_head * hs), ("wk", cfg.n_kv_head * hs),
                               ("wv", cfg.n_kv_head * hs)):
                setattr(layer.attention, name, nn.Linear(C, rows, bias=False))
            layer.attention.wo = nn.Linear(cfg.n_head * hs, C, bias=False)
            layer.feed_forward = nn.Module()
            layer.feed_forward.w1 = nn.Linear(C, cfg.ffn_hidden, bias=False)
            layer.feed_forward.w3 = nn.Linear(C, cfg.ffn_hidden, bias=False)
            layer.feed_forward.w2 = nn.Linear(cfg.ffn_hidden, C, bias=False)
            layer.attention_norm = nn.RMSNorm(C, eps=cfg.norm_eps)
            layer.ffn_norm = nn.RMSNorm(C, eps=cfg.norm_eps)
            self.layers[str(i)] = layer
        self.norm = nn.RMSNorm(C, eps=cfg.norm_eps)
        self.output = nn.Linear(C, cfg.vocab_size, bias=False)

    def _rotate(self, x):  # (B, T, heads, hs)
        hs, T = x.shape[-1], x.shape[1]
        freqs = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hs, 2).float() / hs))
        cis = torch.polar(torch.ones(T, hs // 2), torch.outer(torch.arange(T).float(), freqs))
        z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(z * cis[None, :, None, :]).flatten(3)

    def forward(self, idx):
        cfg, F = self.cfg, torch.nn.functional
        B, T = idx.shape
        h = self.tok_embeddings(idx)
        for layer in self.layers.values():
            a, x = layer.attention, layer.attention_norm(h)
            q = self._rotate(a.wq(x).view(B, T, cfg.n_head, -1)).transpose(1, 2)
            k = self._rotate(a.wk(x).view(B, T, cfg.n_kv_head, -1)).transpose(1, 2)
            v = a.wv(x).view(B, T, cfg.n_kv_head, -1).transpose(1, 2)
            rep = cfg.n_head // cfg.n_kv_head
            y = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                               v.repeat_interleave(rep, 1), is_causal=True)
            h = h + a.wo(y.transpose(1, 2).reshape(B, T, -1))
            f, x = layer.feed_forward, layer.ffn_norm(h)
            h = h + f.w2(F.silu(f.w1(x)) * f.w3(x))
        return self.output(self.norm(h))
