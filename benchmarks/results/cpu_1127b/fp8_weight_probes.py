import sys, math, torch, time
sys.path.insert(0, "benchmarks")
from fp8_kv_scale_sweep import FakeQuantAttention, nll
from pagedllm import LLM
from pagedllm.benchmarks.fp8_accuracy import eval_text
from pagedllm.model.layers import linear as L
import torch.nn.functional as F
E4 = torch.float8_e4m3fn; MAX = 448.0

def q_rows(x, scale):  # fake quant rows of x with scale [rows,1]
    return (x / scale).clamp(-MAX, MAX).to(E4).float() * scale

def w_absmax(w):
    s = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / MAX
    return q_rows(w, s)

def w_mse(w, grid=torch.linspace(0.5, 1.0, 26)):
    best = None; besterr = None
    amax = w.abs().amax(1, keepdim=True).clamp(min=1e-12)
    for g in grid:
        s = amax * g / MAX
        d = q_rows(w, s); e = ((d - w) ** 2).sum(1, keepdim=True)
        if best is None:
            best, besterr = d, e
        else:
            m = e < besterr; best = torch.where(m, d, best); besterr = torch.minimum(e, besterr)
    return best

def w_group(w, g=128):
    n, k = w.shape
    if k % g: return w_absmax(w)
    x = w.reshape(n, k // g, g)
    s = x.abs().amax(2, keepdim=True).clamp(min=1e-12) / MAX
    return ((x / s).clamp(-MAX, MAX).to(E4).float() * s).reshape(n, k)

def w_block(w, b=128):  # 128x128 blocks
    n, k = w.shape
    if n % b or k % b: return w_group(w, b)
    x = w.reshape(n // b, b, k // b, b)
    s = x.abs().amax((1, 3), keepdim=True).clamp(min=1e-12) / MAX
    return ((x / s).clamp(-MAX, MAX).to(E4).float() * s).reshape(n, k)

def a_tok(x):
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / MAX
    return (x / s).clamp(-MAX, MAX).to(E4).float() * s
def a_group(x, g=128):
    k = x.shape[-1]
    if k % g: return a_tok(x)
    y = x.reshape(*x.shape[:-1], k // g, g)
    return a_tok(y).reshape(x.shape)

llm = LLM(quantization="none", dtype="float32", max_model_len=4096, num_gpu_blocks_override=16)
worker = llm.llm_engine.executor.driver_worker
model, tok = worker.model, llm.get_tokenizer()
layers = model.config.num_hidden_layers
ids = tok.encode(eval_text())[:2048]
ph = [(torch.empty(0), torch.empty(0)) for _ in range(layers)]
gemms = [(n, m) for n, m in model.named_modules() if isinstance(m, L.PackableGemm) and not n.endswith("lm_head")]
orig = {n: m.weight.data.clone() for n, m in gemms}
print(len(gemms), "gemms", sorted({n.split('.')[-1] for n, _ in gemms}))
state = {"act": None, "skip": set()}
def matmul(self, x, bias):
    a = state["act"]
    if a is not None and getattr(self, "_qname", None) not in state["skip"] | {None}:
        x = a(x)
    return F.linear(x, self.weight, bias)
for n, m in gemms:
    m._qname = n; m.packed_weight = None
L.PackableGemm.matmul = matmul
def setw(fn, skip=()):
    for n, m in gemms:
        m.weight.data = orig[n] if (fn is None or any(s in n for s in skip)) else fn(orig[n])
    state["skip"] = {n for n, _ in gemms if any(s in n for s in skip)}
def run(name, wfn, afn, kv=False, skip=()):
    setw(wfn, skip); state["act"] = afn
    be = FakeQuantAttention(ph, [(1.0, 1.0)] * layers if kv else None)
    v = nll(model, ids, be, layers)
    return v
base = run("base", None, None)
print(f"base ppl {math.exp(base):.4f}")

def w_fac(f):
    def fn(w):
        s = w.abs().amax(1, keepdim=True).clamp(min=1e-12) * f / MAX
        return q_rows(w, s)
    return fn
def relerr(fn):
    num = den = 0.0
    for n, m in gemms:
        w = orig[n]; num += float(((fn(w) - w) ** 2).sum()); den += float((w ** 2).sum())
    return (num / den) ** 0.5

from pagedllm.worker.kv_scale_calibration import calibration_token_ids
cal = calibration_token_ids(tok, model.config.vocab_size, 4096)
print("calibration tokens", len(cal))
H = {}
def rec(self, x, bias):
    n = getattr(self, "_qname", None)
    if n is not None:
        x2 = x.reshape(-1, x.shape[-1]).double()
        H[n] = H.get(n, 0) + x2.t() @ x2
    return F.linear(x, self.weight, bias)
L.PackableGemm.matmul = rec
setw(None)
def ids_nll(ids_):
    return nll(model, ids_, FakeQuantAttention(ph, None), layers)
ids_nll(cal)
L.PackableGemm.matmul = matmul
import sys
def gptq(w, h, damp=0.01, blocksize=128):
    w = w.double().clone(); n, k = w.shape
    h = h.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1; w[:, dead] = 0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    s = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / MAX
    q = torch.zeros_like(w)
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        w1 = w[:, i1:i2].clone(); e1 = torch.zeros_like(w1); hi = hinv[i1:i2, i1:i2]
        for j in range(i2 - i1):
            col = w1[:, j:j+1]
            qc = (col / s).clamp(-MAX, MAX).float().to(E4).double() * s
            q[:, i1 + j] = qc[:, 0]
            err = (col - qc) / hi[j, j]
            w1[:, j:] -= err @ hi[j:j+1, j:]
            e1[:, j:j+1] = err
        w[:, i2:] -= e1 @ hinv[i1:i2, i2:]
    return q.float()
for damp in (0.01, 0.1):
    t = time.time()
    qw = {n: gptq(orig[n], H[n], damp) for n, _ in gemms}
    print("gptq time", time.time() - t, flush=True)
    for n, m in gemms: m.weight.data = qw[n]
    for af, kv in ((None, False), (a_tok, False), (a_tok, True)):
        state["act"] = af; state["skip"] = set()
        v = nll(model, ids, FakeQuantAttention(ph, [(1.0, 1.0)] * layers if kv else None), layers)
        print(f"GPTQ damp {damp} act={af is not None} kv8={kv} {100*(math.exp(v-base)-1):+.3f}%", flush=True)
