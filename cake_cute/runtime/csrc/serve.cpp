// What a call must be for the native path to serve it: registered by the Python path, plain CUDA tensors
// in the layout the kernels read in place, no transform or mode active. Whatever is not served takes the
// Python path (the route cake_cute/routing.py chose stays the authority).

#include "native.h"

namespace cake_cute_native {

// ---- routing: what may take this path -------------------------------------------------------------

const c10::DispatchKeySet kUnusualKeys({
    c10::DispatchKey::Python,
    c10::DispatchKey::PythonTLSSnapshot,
    c10::DispatchKey::FuncTorchBatched,
    c10::DispatchKey::FuncTorchGradWrapper,
    c10::DispatchKey::Functionalize,
    c10::DispatchKey::Conjugate,
    c10::DispatchKey::Negative,
    c10::DispatchKey::ZeroTensor,
    c10::DispatchKey::NestedTensor,
});

// No functorch transform, torch function mode or dispatch mode is active. functorch includes its
// front-mode dispatch key exactly while a transform layer is on its stack (its thread-local object
// outlives the transforms once torch.func or AOTAutograd under torch.compile has run, so that object's
// presence says nothing).
bool plain_context() {
  return !c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) &&
         !at::impl::torch_function_mode_enabled() && !c10::impl::dispatch_mode_enabled();
}

// The plain strided CUDA tensor `obj` is (a torch.Tensor or nn.Parameter, not a subclass), or nullptr
// for None and for anything else.
const at::Tensor* plain_cuda(PyObject* obj) {
  if (!THPVariable_CheckExact(obj)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.is_cuda() || t.layout() != at::kStrided || t.key_set().has_any(kUnusualKeys)) return nullptr;
  return &t;
}

bool aligned(const at::Tensor& t, int64_t bytes) {
  return t.is_contiguous() && reinterpret_cast<uintptr_t>(t.const_data_ptr()) % bytes == 0;
}

// `t` has x's dtype, device and shape, and is contiguous and aligned.
bool like(const at::Tensor& t, const at::Tensor& x, int64_t align) {
  return t.scalar_type() == x.scalar_type() && t.device() == x.device() && t.sizes().equals(x.sizes()) &&
         aligned(t, align);
}

std::optional<double> number(PyObject* obj) {  // an exact float or int; bools and others: none
  if (PyFloat_CheckExact(obj)) return PyFloat_AS_DOUBLE(obj);
  if (PyLong_CheckExact(obj)) {
    const double value = PyLong_AsDouble(obj);
    if (value == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return std::nullopt;
    }
    return value;
  }
  return std::nullopt;
}

// The eps values the Python path validated (validation.check_eps) and handed over (accept_eps). This side
// serves those and declines any other, so that Python checks it: launched and handed over if valid, refused
// by name if not. The rule lives in Python alone. A slot is written once, before the count that publishes
// it; values beyond the table's size keep the Python path.
constexpr int kMaxAcceptedEps = 8;
std::array<double, kMaxAcceptedEps> accepted_eps{};
std::atomic<int> accepted_eps_count{0};
std::mutex accepted_eps_mutex;

bool validated_eps(double eps) {
  const int count = accepted_eps_count.load(std::memory_order_acquire);
  for (int i = 0; i < count; ++i) {
    if (accepted_eps[i] == eps) return true;
  }
  return false;
}

void accept_eps(double eps) {
  std::lock_guard<std::mutex> lock(accepted_eps_mutex);
  const int count = accepted_eps_count.load(std::memory_order_relaxed);
  if (validated_eps(eps) || count == kMaxAcceptedEps) return;
  accepted_eps[count] = eps;
  accepted_eps_count.store(count + 1, std::memory_order_release);
}

SignatureKey signature_key(const at::Tensor& x, const at::Tensor& w, double weight_offset) {
  SignatureKey key{x.scalar_type(), w.scalar_type(), x.dim(), x.size(-1), x.device().index(), 0};
  std::memcpy(&key.offset_bits, &weight_offset, sizeof(double));
  return key;
}

// The registered signature of (x, w, weight_offset) when x and w have the layout the kernels read in
// place, else nullptr. Memory safety: the kernels were compiled for this signature's H and alignments and
// read x, w in place, so w's length and device, x's rows (at least one), contiguity and alignment are
// checked here on every call; `like` does the same for every other activation-shaped tensor.
const Signature* find_signature(const at::Tensor& x, const at::Tensor& w, double weight_offset) {
  if (x.dim() < 2) return nullptr;
  const Signature* s = nullptr;
  {
    std::shared_lock lock(signatures_mutex);
    auto found = signatures.find(signature_key(x, w, weight_offset));
    if (found == signatures.end()) return nullptr;
    s = found->second;
  }
  const bool usable = w.dim() == 1 && w.size(0) == s->hidden && w.device() == x.device() && x.numel() > 0 &&
                      aligned(x, s->act_align) && aligned(w, s->w_align);
  return usable ? s : nullptr;
}

const Signature* find_signature(const at::Tensor& x, const at::Tensor& w, PyObject* weight_offset) {
  const std::optional<double> offset = number(weight_offset);
  return offset ? find_signature(x, w, *offset) : nullptr;
}


// (x, w, eps, residual, weight_offset) when this path serves them; the forward kernel is registered.
std::optional<ForwardCall> forward_call(PyObject* const* args) {
  if (!plain_context()) return std::nullopt;
  const at::Tensor* x = plain_cuda(args[0]);
  const at::Tensor* w = plain_cuda(args[1]);
  const std::optional<double> eps = number(args[2]);
  const bool residual = args[3] != Py_None;
  const at::Tensor* r = residual ? plain_cuda(args[3]) : nullptr;
  if (x == nullptr || w == nullptr || (residual && r == nullptr) || !eps || !validated_eps(*eps)) {
    return std::nullopt;
  }
  const Signature* s = find_signature(*x, *w, args[4]);
  if (s == nullptr || s->forward[residual] == nullptr || (residual && !like(*r, *x, s->act_align))) {
    return std::nullopt;
  }
  return ForwardCall{x, w, r, s, *eps};
}

// Whether autograd records a node for a call: grad mode on and an input that requires a gradient.
bool records_graph(const at::Tensor& x, const at::Tensor& w, const at::Tensor* residual) {
  return at::GradMode::is_enabled() &&
         (x.requires_grad() || w.requires_grad() || (residual != nullptr && residual->requires_grad()));
}

bool records_graph(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& residual) {
  return records_graph(x, w, residual.has_value() ? &*residual : nullptr);
}

}  // namespace cake_cute_native
