// cake_cute's native host path: the eager autograd node and the functional forward and backward of
// RMSNorm in C++, launching the compiled CuTe kernels through TVM-FFI's C ABI (TVMFFIFunctionCall)
// with DLTensor arguments built on the stack.
//
// Python stays the authority on what is valid. A call is served here only when
//   * its (x, w, weight_offset) signature was validated and registered by the Python path
//     (cake_cute/native.py registers it after the Python path launched it once), and
//   * it has the plain layout the kernels read in place: CUDA tensors that are contiguous and
//     vector-aligned, with no tensor subclass, torch function or dispatch mode, functorch wrapper,
//     conjugate / negative / zero view, and at least one row.
// Anything else answers None and the caller takes the Python path, which raises the named
// TypeError / ValueError before any launch and handles views, copies and caller-owned outputs. The
// backward's launch plan (kernels, programs, FP32 partial rows of dW) also comes from Python, asked
// once per (signature, T, residual, dw dtype) and cached here, so the kernels and the plan are
// exactly those the Python path launches with.
//
// Outputs come from torch's caching allocator (CUDA-graph capture works) and every kernel runs on
// torch's current stream, set as TVM-FFI's environment stream around the call (the kernels read it
// from there). Building needs torch's and TVM-FFI's headers and libraries only: the stream comes
// through torch's DLPack exchange API, so neither CUDA headers nor libc10_cuda are involved.

// TVM-FFI first: its dlpack.h declares the exchange API, and torch's copy has the same guard.
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- what Python registered ----------------------------------------------------------------------

struct SignatureKey {  // every property of (x, w) the Python checks read, and the weight offset
  at::ScalarType act, weight;
  int64_t dims, hidden;
  c10::DeviceIndex device;
  uint64_t offset_bits;
  bool operator==(const SignatureKey&) const = default;
};

struct SignatureKeyHash {
  size_t operator()(const SignatureKey& k) const {
    size_t h = std::hash<uint64_t>()(k.offset_bits);
    for (int64_t part : {int64_t(k.act), int64_t(k.weight), k.dims, k.hidden, int64_t(k.device)}) {
      h = h * 1000003u ^ std::hash<int64_t>()(part);
    }
    return h;
  }
};

struct Signature {
  int64_t hidden;
  int64_t act_align, w_align;  // byte alignment the kernels assume for rows of x and for w
  TVMFFIObjectHandle forward[2] = {nullptr, nullptr};  // plain, residual; null until registered
  TVMFFIObjectHandle fp8[2][2][2][2] = {};  // [recipe: mxfp8, 1x128][emit_y][residual][persistent]
  PyObject* planner;  // Python: (rows, residual, dw_dtype, g_parts) -> (bwd, dw, programs, partial_rows, stride)
  // The FP8 forward's launch rule as Python hands it over (launch_plan.fp8_forward_rule): up to fp8_persistent_rows
  // rows the persistent kernel runs at most fp8_programs[residual] programs (0: never persistent).
  int64_t fp8_programs[2] = {0, 0};
  int64_t fp8_persistent_rows = 0;
};

// Signatures are never freed: a clear (a config override in tests and tuning) only forgets them, so an
// autograd graph recorded before it still runs its backward. Written under the GIL; the custom ops'
// kernels read it without the GIL (the dispatcher is entered with it released), hence the lock.
std::unordered_map<SignatureKey, Signature*, SignatureKeyHash> signatures;
std::shared_mutex signatures_mutex;

struct Plan {  // one backward call shape, as the Python path plans it
  TVMFFIObjectHandle bwd, dw;
  int64_t programs, partial_rows, row_stride;
};

struct PlanKey {
  const Signature* signature;
  int64_t rows;
  bool residual;
  at::ScalarType dw;
  int64_t g_parts;  // g's summands: 1, or 2-3 for rmsnorm_bwd_parts
  bool operator==(const PlanKey&) const = default;
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    return std::hash<const void*>()(k.signature) ^ (std::hash<int64_t>()(k.rows) * 31u) ^
           (size_t(k.residual) << 7) ^ (size_t(k.dw) << 9) ^ (size_t(k.g_parts) << 17);
  }
};

// Backwards run on autograd's device threads without the GIL: the plans have their own lock. The cache
// is bounded (a new T per step must not grow it forever); plans are copied out, so a clear is safe.
constexpr size_t kMaxPlans = 4096;
constexpr int64_t kMaxGParts = 3;  // g's summands at most (validation.MAX_GRADIENT_PARTS)
std::mutex plans_mutex;
std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;

const DLPackExchangeAPI* torch_dlpack = nullptr;  // torch's, for its current stream

// ---- TVM-FFI calls ----------------------------------------------------------------------------

struct TensorArg {  // a DLTensor with its shape and strides, on the caller's stack
  DLTensor dl;
  int64_t shape[2];
  int64_t strides[2];
};

DLDataType dl_dtype(at::ScalarType t) {
  if (t == at::kBFloat16) return {kDLBfloat, 16, 1};
  if (t == at::kByte) return {kDLUInt, 8, 1};  // e4m3 data and E8M0 scales, passed as their bytes
  return {kDLFloat, uint8_t(t == at::kHalf ? 16 : 32), 1};  // fp16 or fp32: the only others admitted
}

TVMFFIAny tensor_arg(TensorArg& a, const at::Tensor& t, int32_t dims, int64_t rows, int64_t cols,
                     int64_t row_stride) {
  a.shape[0] = rows;
  a.shape[1] = cols;
  a.strides[0] = dims == 2 ? row_stride : 1;
  a.strides[1] = 1;
  a.dl.data = const_cast<void*>(t.const_data_ptr());
  a.dl.device = {kDLCUDA, int32_t(t.device().index())};
  a.dl.ndim = dims;
  a.dl.dtype = dl_dtype(t.scalar_type());
  a.dl.shape = a.shape;
  a.dl.strides = a.strides;
  a.dl.byte_offset = 0;
  TVMFFIAny any{};
  any.type_index = kTVMFFIDLTensorPtr;
  any.v_ptr = &a.dl;
  return any;
}

TVMFFIAny matrix(TensorArg& a, const at::Tensor& t, int64_t rows, int64_t cols) {
  return tensor_arg(a, t, 2, rows, cols, cols);
}

TVMFFIAny vector(TensorArg& a, const at::Tensor& t, int64_t length) {
  return tensor_arg(a, t, 1, length, 0, 1);
}

TVMFFIAny none() {
  TVMFFIAny any{};
  any.type_index = kTVMFFINone;
  return any;
}

TVMFFIAny real(double value) {
  TVMFFIAny any{};
  any.type_index = kTVMFFIFloat;
  any.v_float64 = value;
  return any;
}

TVMFFIAny integer(int64_t value) {
  TVMFFIAny any{};
  any.type_index = kTVMFFIInt;
  any.v_int64 = value;
  return any;
}

[[noreturn]] void throw_ffi_error(const char* what) {
  TVMFFIObjectHandle error = nullptr;
  TVMFFIErrorMoveFromRaised(&error);
  std::string message = std::string("cake_cute: ") + what + " failed";
  if (error != nullptr) {  // the error object is {TVMFFIObject header, TVMFFIErrorCell}
    auto* cell = reinterpret_cast<const TVMFFIErrorCell*>(static_cast<const char*>(error) + sizeof(TVMFFIObject));
    message += ": " + std::string(cell->kind.data, cell->kind.size) + ": " +
               std::string(cell->message.data, cell->message.size);
    TVMFFIObjectDecRef(error);
  }
  throw std::runtime_error(message);
}

void call(TVMFFIObjectHandle kernel, TVMFFIAny* args, int32_t count, const char* what) {
  TVMFFIAny result = none();
  if (TVMFFIFunctionCall(kernel, args, count, &result) != 0) throw_ffi_error(what);
}

// The launch context: x's device current, and torch's current stream of it as TVM-FFI's environment
// stream (restored afterwards), exactly as TVM-FFI's Python binding does around a call with torch tensors.
class LaunchScope {
 public:
  explicit LaunchScope(const at::Device& device) : guard_(device), device_(device.index()) {
    void* stream = nullptr;
    if (torch_dlpack->current_work_stream(kDLCUDA, device_, &stream) != 0) {
      throw std::runtime_error("cake_cute: torch gave no current CUDA stream");
    }
    if (TVMFFIEnvSetStream(kDLCUDA, device_, stream, &previous_) != 0) throw_ffi_error("TVMFFIEnvSetStream");
  }
  ~LaunchScope() { TVMFFIEnvSetStream(kDLCUDA, device_, previous_, nullptr); }
  LaunchScope(const LaunchScope&) = delete;
  LaunchScope& operator=(const LaunchScope&) = delete;

 private:
  c10::DeviceGuard guard_;
  int32_t device_;
  TVMFFIStreamHandle previous_ = nullptr;
};

// ---- the launches ------------------------------------------------------------------------------

struct ForwardOutputs {
  at::Tensor y, rstd, h_new;  // h_new undefined in plain mode
};

// rstd is `[rows]`, or x's shape without its last dimension when `row_shaped_rstd` (the custom op's form).
ForwardOutputs launch_forward(const Signature& s, const at::Tensor& x, const at::Tensor& w,
                              const at::Tensor* residual, double eps, bool row_shaped_rstd = false) {
  const int64_t rows = x.numel() / s.hidden;
  const at::Tensor rstd_storage = row_shaped_rstd ? at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat))
                                                  : at::empty({rows}, x.options().dtype(at::kFloat));
  ForwardOutputs out{at::empty(x.sizes(), x.options()), rstd_storage, {}};
  if (residual != nullptr) out.h_new = at::empty(x.sizes(), x.options());
  TensorArg xa, ra, wa, ya, ha, rstd;
  TVMFFIAny args[] = {
      matrix(xa, x, rows, s.hidden),
      residual != nullptr ? matrix(ra, *residual, rows, s.hidden) : none(),
      vector(wa, w, s.hidden),
      matrix(ya, out.y, rows, s.hidden),
      residual != nullptr ? matrix(ha, out.h_new, rows, s.hidden) : none(),
      vector(rstd, out.rstd, rows),
      real(eps),
  };
  LaunchScope scope(x.device());
  call(s.forward[residual != nullptr], args, 7, "the forward kernel");
  return out;
}

// The recipes of the FP8 forward (fp8.QUANT_RECIPES' order) and their block widths along H.
constexpr const char* kFp8Recipes[2] = {"mxfp8", "1x128"};
constexpr int64_t kFp8Blocks[2] = {32, 128};

std::optional<int> fp8_recipe(c10::string_view recipe) {
  for (int i = 0; i < 2; ++i) {
    if (recipe == kFp8Recipes[i]) return i;
  }
  return std::nullopt;
}

using Fp8Result = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The op's outputs, as custom_ops.rmsnorm_fp8_fwd returns them: e4m3 data in x's shape, compact scales
// (x's leading dims, blocks; E8M0 or FP32), y or a zero-memory placeholder, rstd (x's leading dims),
// h_new or empty.
// ``programs`` > 0: the persistent kernel, which takes the most programs to run after eps.
Fp8Result launch_fp8(const at::Tensor& x, const at::Tensor& w, const at::Tensor* residual, double eps, int recipe,
                     bool emit_y, int64_t hidden, TVMFFIObjectHandle kernel, int64_t programs) {
  const int64_t rows = x.numel() / hidden;
  const int64_t blocks = (hidden + kFp8Blocks[recipe] - 1) / kFp8Blocks[recipe];
  const bool fp32_scales = recipe == 1;
  at::Tensor data = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scales = at::empty({rows, blocks}, x.options().dtype(fp32_scales ? at::kFloat : at::kByte));
  at::Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  at::Tensor y = emit_y ? at::empty(x.sizes(), x.options()) : at::zeros({}, x.options()).expand(x.sizes());
  at::Tensor h_new = residual != nullptr ? at::empty(x.sizes(), x.options()) : at::empty({0}, x.options());
  const at::Tensor data_bytes = data.view(at::kByte);
  TensorArg xa, ra, wa, ya, ha, rstd_arg, qa, sa;
  TVMFFIAny args[] = {
      matrix(xa, x, rows, hidden),
      residual != nullptr ? matrix(ra, *residual, rows, hidden) : none(),
      vector(wa, w, hidden),
      emit_y ? matrix(ya, y, rows, hidden) : none(),
      residual != nullptr ? matrix(ha, h_new, rows, hidden) : none(),
      vector(rstd_arg, rstd, rows),
      matrix(qa, data_bytes, rows, hidden),
      matrix(sa, scales, rows, blocks),
      real(eps),
      integer(programs),
  };
  {
    LaunchScope scope(x.device());
    call(kernel, args, programs > 0 ? 10 : 9, "the FP8 forward kernel");
  }
  std::vector<int64_t> scale_shape(x.sizes().begin(), x.sizes().end() - 1);
  scale_shape.push_back(blocks);
  scales = scales.view(scale_shape);
  if (!fp32_scales) scales = scales.view(at::kFloat8_e8m0fnu);
  return {std::move(data), std::move(scales), std::move(y), std::move(rstd), std::move(h_new)};
}

// Holds the GIL for its scope: backwards run on autograd's threads and the dispatcher calls the op
// kernels with the GIL released, so Python is entered through one of these.
class GilScope {
 public:
  GilScope() : state_(PyGILState_Ensure()) {}
  ~GilScope() { PyGILState_Release(state_); }
  GilScope(const GilScope&) = delete;
  GilScope& operator=(const GilScope&) = delete;

 private:
  PyGILState_STATE state_;
};

Plan backward_plan(const Signature& s, int64_t rows, bool residual, at::ScalarType dw, int64_t g_parts) {
  const PlanKey key{&s, rows, residual, dw, g_parts};
  {
    std::lock_guard<std::mutex> lock(plans_mutex);
    auto found = plans.find(key);
    if (found != plans.end()) return found->second;
  }
  Plan plan;
  {
    GilScope gil;
    PyObject* answer = PyObject_CallFunction(s.planner, "LOOL", static_cast<long long>(rows),
                                             residual ? Py_True : Py_False, reinterpret_cast<PyObject*>(torch::getTHPDtype(dw)),
                                             static_cast<long long>(g_parts));
    unsigned long long bwd = 0, reduce = 0;
    long long programs = 0, partial_rows = 0, row_stride = 0;
    const bool parsed = answer != nullptr && PyArg_ParseTuple(answer, "KKLLL", &bwd, &reduce, &programs,
                                                              &partial_rows, &row_stride);
    Py_XDECREF(answer);
    if (!parsed) {
      python_error error;  // the planner's exception, re-raised where the backward was called
      error.persist();
      throw error;
    }
    plan = {reinterpret_cast<TVMFFIObjectHandle>(bwd), reinterpret_cast<TVMFFIObjectHandle>(reduce), programs,
            partial_rows, row_stride};
    // Taken while the GIL keeps Python's kernel objects alive, and held for the process: a cleared plan
    // may still be in use by another thread's launch.
    TVMFFIObjectIncRef(plan.bwd);
    TVMFFIObjectIncRef(plan.dw);
  }
  std::lock_guard<std::mutex> lock(plans_mutex);
  if (plans.size() >= kMaxPlans) plans.clear();
  plans.emplace(key, plan);
  return plan;
}

// dx (x's shape) and, when `want_dw`, dw in `dw_dtype`; g_residual undefined in plain mode. `more_g`: g's
// other summands (rmsnorm_bwd_parts), in summation order after `g`.
std::pair<at::Tensor, at::Tensor> launch_backward(const Signature& s, const at::Tensor& g, const at::Tensor& h,
                                                  const at::Tensor& w, const at::Tensor& rstd,
                                                  const at::Tensor& g_residual, at::ScalarType dw_dtype,
                                                  bool want_dw, at::TensorList more_g = {}) {
  const int64_t rows = h.numel() / s.hidden;
  const bool residual = g_residual.defined();
  const Plan plan = backward_plan(s, rows, residual, dw_dtype, 1 + int64_t(more_g.size()));
  at::Tensor dx = at::empty(h.sizes(), h.options());
  at::Tensor partials = at::empty({plan.partial_rows * plan.row_stride}, h.options().dtype(at::kFloat));
  at::Tensor dw = want_dw ? at::empty({s.hidden}, w.options().dtype(dw_dtype)) : at::Tensor();
  TensorArg ga, ha, wa, ra, gra, dxa, pa, dwa, more[kMaxGParts - 1];
  const TVMFFIAny partials_arg = tensor_arg(pa, partials, 2, plan.partial_rows, s.hidden, plan.row_stride);
  TVMFFIAny args[8 + kMaxGParts - 1] = {
      matrix(ga, g, rows, s.hidden),
      matrix(ha, h, rows, s.hidden),
      vector(wa, w, s.hidden),
      vector(ra, rstd, rows),
      residual ? matrix(gra, g_residual, rows, s.hidden) : none(),
      matrix(dxa, dx, rows, s.hidden),
      partials_arg,
      integer(plan.programs),
  };
  for (size_t i = 0; i < more_g.size(); ++i) args[8 + i] = matrix(more[i], more_g[i], rows, s.hidden);
  LaunchScope scope(h.device());
  call(plan.bwd, args, int32_t(8 + more_g.size()), "the backward kernel");
  if (want_dw) {
    TVMFFIAny reduce_args[] = {partials_arg, vector(dwa, dw, s.hidden)};
    call(plan.dw, reduce_args, 2, "the dW reduction");
  }
  return {dx, dw};
}

// ---- the autograd node ---------------------------------------------------------------------------

// Saves exactly (x or h_new, w, rstd), like CakeRMSNormFunction; unused gradients stay undefined.
struct NormFunction : public torch::autograd::Function<NormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                               const std::optional<at::Tensor>& residual, const Signature* s, double eps) {
    ForwardOutputs out = launch_forward(*s, x, w, residual ? &*residual : nullptr, eps);
    ctx->set_materialize_grads(false);
    ctx->saved_data["signature"] = reinterpret_cast<int64_t>(s);
    ctx->save_for_backward({residual ? out.h_new : x, w, out.rstd});
    if (residual) return {out.y, out.h_new};
    return {out.y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool residual = grads.size() == 2;
    const at::Tensor g_residual = residual ? grads[1] : at::Tensor();
    if (!grads[0].defined()) return {g_residual, {}, g_residual, {}, {}};  // only h_new was used
    const auto* s = reinterpret_cast<const Signature*>(ctx->saved_data["signature"].toInt());
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& w = saved[1];
    auto [dx, dw] = launch_backward(*s, kernel_rows(grads[0], s->act_align), saved[0], w, saved[2],
                                    g_residual.defined() ? kernel_rows(g_residual, s->act_align) : at::Tensor(),
                                    w.scalar_type(), ctx->needs_input_grad(1));
    return {dx, dw, residual ? dx : at::Tensor(), {}, {}};
  }

  // A gradient from autograd as the kernels read it (an expanded or offset one becomes a copy).
  static at::Tensor kernel_rows(const at::Tensor& t, int64_t align) {
    const bool direct = t.is_contiguous() && reinterpret_cast<uintptr_t>(t.const_data_ptr()) % align == 0;
    return direct ? t : t.clone(at::MemoryFormat::Contiguous);
  }
};

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

SignatureKey signature_key(const at::Tensor& x, const at::Tensor& w, double weight_offset) {
  SignatureKey key{x.scalar_type(), w.scalar_type(), x.dim(), x.size(-1), x.device().index(), 0};
  std::memcpy(&key.offset_bits, &weight_offset, sizeof(double));
  return key;
}

// The registered signature of (x, w, weight_offset) when x and w have the layout the kernels read in
// place, else nullptr.
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

struct ForwardCall {
  const at::Tensor *x, *w, *residual;
  const Signature* signature;
  double eps;
};

// (x, w, eps, residual, weight_offset) when this path serves them; the forward kernel is registered.
std::optional<ForwardCall> forward_call(PyObject* const* args) {
  if (!plain_context()) return std::nullopt;
  const at::Tensor* x = plain_cuda(args[0]);
  const at::Tensor* w = plain_cuda(args[1]);
  const std::optional<double> eps = number(args[2]);
  const bool residual = args[3] != Py_None;
  const at::Tensor* r = residual ? plain_cuda(args[3]) : nullptr;
  if (x == nullptr || w == nullptr || (residual && r == nullptr) || !eps || !std::isfinite(*eps) || *eps < 0) {
    return std::nullopt;
  }
  const Signature* s = find_signature(*x, *w, args[4]);
  if (s == nullptr || s->forward[residual] == nullptr || (residual && !like(*r, *x, s->act_align))) {
    return std::nullopt;
  }
  return ForwardCall{x, w, r, s, *eps};
}

PyObject* tuple_of(std::initializer_list<at::Tensor> tensors) {
  PyObject* tuple = PyTuple_New(Py_ssize_t(tensors.size()));
  if (tuple == nullptr) return nullptr;
  Py_ssize_t i = 0;
  for (const at::Tensor& t : tensors) {
    PyObject* item = THPVariable_Wrap(t);
    if (item == nullptr) {
      Py_DECREF(tuple);
      return nullptr;
    }
    PyTuple_SET_ITEM(tuple, i++, item);
  }
  return tuple;
}

bool check_count(Py_ssize_t given, Py_ssize_t expected, const char* name) {
  if (given == expected) return true;
  PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, expected, given);
  return false;
}

// ---- the custom ops' kernels ---------------------------------------------------------------------
//
// Under torch.compile (and wherever else `cake_cute::rmsnorm_fwd` / `rmsnorm_bwd` / `rmsnorm_bwd_parts` /
// `rmsnorm_fp8_fwd` are called) every call goes through the dispatcher. With Python kernels there, each call pays torch.library's
// Python autograd layer and a Python backend kernel (about 28 us per forward and 8 us per backward on the H200's host,
// perf/results/2026-12-01-h200-compiled-host-profile/). Once the extension is loaded these C++ kernels
// take the CUDA keys: the CUDA kernels launch served signatures directly and hand every other call to
// the op's Python body; the AutogradCUDA kernel redispatches below autograd when there is no graph to
// record (a compiled graph's case) and otherwise records a C++ node whose backward calls `rmsnorm_bwd`,
// as the Python registration does for the other devices (`custom_ops._setup_context` / `_backward`).

using ForwardResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using ForwardSchema = ForwardResult(const at::Tensor&, const at::Tensor&, double, const std::optional<at::Tensor>&,
                                    double, bool);
using BackwardResult = std::tuple<at::Tensor, at::Tensor>;
using BackwardSchema = BackwardResult(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const std::optional<at::Tensor>&, double, bool);

PyObject* python_forward_op = nullptr;   // custom_ops.rmsnorm_fwd: every call these kernels do not serve
PyObject* python_backward_op = nullptr;  // custom_ops.rmsnorm_bwd
PyObject* python_backward_parts_op = nullptr;  // custom_ops.rmsnorm_bwd_parts
PyObject* python_fp8_op = nullptr;             // custom_ops.rmsnorm_fp8_fwd

const c10::TypedOperatorHandle<ForwardSchema>& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("cake_cute::rmsnorm_fwd", "").typed<ForwardSchema>();
  return op;
}

const c10::TypedOperatorHandle<BackwardSchema>& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("cake_cute::rmsnorm_bwd", "").typed<BackwardSchema>();
  return op;
}

PyObject* wrap_optional(const std::optional<at::Tensor>& t) {
  if (t && t->defined()) return THPVariable_Wrap(*t);
  Py_RETURN_NONE;
}

// Calls a Python op body with (tensors..., optional tensor, weight_offset, deterministic) in the schema's
// order and returns its tuple of tensors; its exception (a named TypeError / ValueError) is re-raised
// at the op's caller. The caller holds the GIL (a GilScope).
std::vector<at::Tensor> call_python_op(PyObject* body, std::initializer_list<PyObject*> args, size_t outputs) {
  std::vector<at::Tensor> result;
  PyObject* tuple = PyTuple_New(Py_ssize_t(args.size()));
  Py_ssize_t i = 0;
  for (PyObject* arg : args) PyTuple_SET_ITEM(tuple, i++, arg);  // steals each reference
  PyObject* answer = PyObject_CallObject(body, tuple);
  Py_DECREF(tuple);
  if (answer != nullptr && PyTuple_Check(answer) && size_t(PyTuple_GET_SIZE(answer)) == outputs) {
    for (size_t k = 0; k < outputs; ++k) result.push_back(THPVariable_Unpack(PyTuple_GET_ITEM(answer, k)));
  } else if (answer != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "cake_cute: a custom op's Python body returned an unexpected value");
  }
  Py_XDECREF(answer);
  if (result.size() != outputs) {
    python_error error;
    error.persist();
    throw error;
  }
  return result;
}

ForwardResult forward_cuda(const at::Tensor& x, const at::Tensor& w, double eps,
                           const std::optional<at::Tensor>& residual, double weight_offset, bool deterministic) {
  const bool with_residual = residual.has_value() && residual->defined();
  const Signature* s = std::isfinite(eps) && eps >= 0 && x.layout() == at::kStrided ? find_signature(x, w, weight_offset)
                                                                                     : nullptr;
  if (s != nullptr && s->forward[with_residual] != nullptr && (!with_residual || like(*residual, x, s->act_align))) {
    ForwardOutputs out = launch_forward(*s, x, w, with_residual ? &*residual : nullptr, eps, true);
    if (!with_residual) out.h_new = at::empty({0}, x.options());
    return {std::move(out.y), std::move(out.rstd), std::move(out.h_new)};
  }
  GilScope gil;
  auto outs = call_python_op(python_forward_op,
                             {THPVariable_Wrap(x), THPVariable_Wrap(w), PyFloat_FromDouble(eps), wrap_optional(residual),
                              PyFloat_FromDouble(weight_offset), PyBool_FromLong(deterministic)},
                             3);
  return {outs[0], outs[1], outs[2]};
}

// Whether the launch path takes this backward: a registered signature, every g like x, rstd one FP32 value
// per row. Otherwise the op's Python body validates and launches (or raises the named error).
const Signature* served_backward(at::TensorList gs, const at::Tensor& x, const at::Tensor& w, const at::Tensor& rstd,
                                 const std::optional<at::Tensor>& g_residual, double weight_offset) {
  const Signature* s = x.layout() == at::kStrided ? find_signature(x, w, weight_offset) : nullptr;
  if (s == nullptr) return nullptr;
  for (const at::Tensor& g : gs) {
    if (!like(g, x, s->act_align)) return nullptr;
  }
  const bool with_residual = g_residual.has_value() && g_residual->defined();
  const bool served = (!with_residual || like(*g_residual, x, s->act_align)) && rstd.scalar_type() == at::kFloat &&
                      rstd.numel() == x.numel() / s->hidden && rstd.device() == x.device() && rstd.is_contiguous();
  return served ? s : nullptr;
}

at::Tensor optional_or_undefined(const std::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}

BackwardResult backward_cuda(const at::Tensor& g, const at::Tensor& x, const at::Tensor& w, const at::Tensor& rstd,
                             const std::optional<at::Tensor>& g_residual, double weight_offset, bool deterministic) {
  if (const Signature* s = served_backward({g}, x, w, rstd, g_residual, weight_offset)) {
    auto [dx, dw] = launch_backward(*s, g, x, w, rstd, optional_or_undefined(g_residual), w.scalar_type(), true);
    return {std::move(dx), std::move(dw)};
  }
  GilScope gil;
  auto outs = call_python_op(python_backward_op,
                             {THPVariable_Wrap(g), THPVariable_Wrap(x), THPVariable_Wrap(w), THPVariable_Wrap(rstd),
                              wrap_optional(g_residual), PyFloat_FromDouble(weight_offset), PyBool_FromLong(deterministic)},
                             2);
  return {outs[0], outs[1]};
}

// rmsnorm_bwd_parts: g given as its 2-3 summands (cake_cute.graph_passes puts it in compiled graphs).
BackwardResult backward_parts_cuda(at::TensorList g, const at::Tensor& x, const at::Tensor& w, const at::Tensor& rstd,
                                   const std::optional<at::Tensor>& g_residual, double weight_offset,
                                   bool deterministic) {
  const bool parts_ok = g.size() >= 2 && int64_t(g.size()) <= kMaxGParts;
  if (const Signature* s = parts_ok ? served_backward(g, x, w, rstd, g_residual, weight_offset) : nullptr) {
    auto [dx, dw] = launch_backward(*s, g[0], x, w, rstd, optional_or_undefined(g_residual), w.scalar_type(), true,
                                    g.slice(1));
    return {std::move(dx), std::move(dw)};
  }
  GilScope gil;
  PyObject* parts = PyList_New(Py_ssize_t(g.size()));
  for (size_t i = 0; i < g.size(); ++i) PyList_SET_ITEM(parts, Py_ssize_t(i), THPVariable_Wrap(g[i]));
  auto outs = call_python_op(python_backward_parts_op,
                             {parts, THPVariable_Wrap(x), THPVariable_Wrap(w), THPVariable_Wrap(rstd),
                              wrap_optional(g_residual), PyFloat_FromDouble(weight_offset), PyBool_FromLong(deterministic)},
                             2);
  return {outs[0], outs[1]};
}

// Whether autograd records a node for a call: grad mode on and an input that requires a gradient.
bool records_graph(const at::Tensor& x, const at::Tensor& w, const at::Tensor* residual) {
  return at::GradMode::is_enabled() &&
         (x.requires_grad() || w.requires_grad() || (residual != nullptr && residual->requires_grad()));
}

bool records_graph(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& residual) {
  return records_graph(x, w, residual.has_value() ? &*residual : nullptr);
}

// What both forward ops' autograd nodes save: (x or h_new, w, rstd), the mode and the offset; the outputs
// in `non_differentiable`, and h_new in plain mode, get no gradient; an unused output's stays undefined.
void save_norm_inputs(AutogradContext* ctx, std::vector<at::Tensor> non_differentiable, const at::Tensor& x,
                      const at::Tensor& w, const at::Tensor& rstd, const at::Tensor& h_new,
                      const std::optional<at::Tensor>& residual, double weight_offset) {
  const bool with_residual = residual.has_value() && residual->defined();
  ctx->set_materialize_grads(false);
  if (!with_residual) non_differentiable.push_back(h_new);
  ctx->mark_non_differentiable(non_differentiable);
  ctx->save_for_backward({with_residual ? h_new : x, w, rstd});
  ctx->saved_data["residual"] = with_residual;
  ctx->saved_data["weight_offset"] = weight_offset;
}

// (dx, dw) of a node saved by save_norm_inputs, from y's gradient `g` (defined) and, in residual mode,
// h_new's (undefined when h_new was unused): rmsnorm_bwd on the saved tensors.
std::tuple<at::Tensor, at::Tensor> norm_gradients(AutogradContext* ctx, const at::Tensor& g,
                                                  const at::Tensor& g_residual, bool deterministic) {
  const variable_list saved = ctx->get_saved_variables();
  std::optional<at::Tensor> g_res;
  if (ctx->saved_data["residual"].toBool()) g_res = g_residual;
  return backward_op().call(g, saved[0], saved[1], saved[2], g_res, ctx->saved_data["weight_offset"].toDouble(),
                            deterministic);
}

// The op's autograd formula: one dx is the gradient of x and residual.
struct OpNormFunction : public torch::autograd::Function<OpNormFunction> {
  static variable_list forward(AutogradContext* ctx, c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& w,
                               double eps, const std::optional<at::Tensor>& residual, double weight_offset,
                               bool deterministic) {
    auto [y, rstd, h_new] = below_autograd(keys, x, w, eps, residual, weight_offset, deterministic);
    save_norm_inputs(ctx, {rstd}, x, w, rstd, h_new, residual, weight_offset);
    ctx->saved_data["deterministic"] = deterministic;
    return {y, rstd, h_new};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool residual = ctx->saved_data["residual"].toBool();
    const at::Tensor g_residual = residual ? grads[2] : at::Tensor();
    // One gradient per forward argument: (keys, x, w, eps, residual, weight_offset, deterministic).
    if (!grads[0].defined()) return {{}, g_residual, {}, {}, g_residual, {}, {}};
    auto [dx, dw] = norm_gradients(ctx, grads[0], g_residual, ctx->saved_data["deterministic"].toBool());
    return {{}, dx, dw, {}, residual ? dx : at::Tensor(), {}, {}};
  }

  static ForwardResult below_autograd(c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& w, double eps,
                                      const std::optional<at::Tensor>& residual, double weight_offset,
                                      bool deterministic) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return forward_op().redispatch(keys & c10::after_ADInplaceOrView_keyset, x, w, eps, residual, weight_offset,
                                   deterministic);
  }
};

ForwardResult forward_autograd_cuda(c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& w, double eps,
                                    const std::optional<at::Tensor>& residual, double weight_offset,
                                    bool deterministic) {
  if (!records_graph(x, w, residual)) {
    return OpNormFunction::below_autograd(keys, x, w, eps, residual, weight_offset, deterministic);
  }
  variable_list out = OpNormFunction::apply(keys, x, w, eps, residual, weight_offset, deterministic);
  return {out[0], out[1], out[2]};
}

// ---- cake_cute::rmsnorm_fp8_fwd -------------------------------------------------------------------

using Fp8Schema = Fp8Result(const at::Tensor&, const at::Tensor&, double, const std::optional<at::Tensor>&,
                            c10::string_view, bool, double);

const c10::TypedOperatorHandle<Fp8Schema>& fp8_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("cake_cute::rmsnorm_fp8_fwd", "").typed<Fp8Schema>();
  return op;
}

// The registered FP8 forward of this call when the launch path takes it (the forward's conditions, and
// the recipe's kernel of this emit_y, mode and row count registered), else nullptr: the op's Python body
// validates and launches (or raises the named error). ``programs``: what launch_fp8 takes.
TVMFFIObjectHandle served_fp8(const at::Tensor& x, const at::Tensor& w, double eps,
                              const std::optional<at::Tensor>& residual, std::optional<int> recipe, bool emit_y,
                              double weight_offset, const Signature** signature, int64_t* programs) {
  const bool with_residual = residual.has_value() && residual->defined();
  if (!recipe || !std::isfinite(eps) || eps < 0 || x.layout() != at::kStrided) return nullptr;
  const Signature* s = find_signature(x, w, weight_offset);
  if (s == nullptr || (with_residual && !like(*residual, x, s->act_align))) return nullptr;
  *signature = s;
  const int64_t cap = s->fp8_programs[with_residual];
  const bool persistent = cap > 0 && x.numel() / s->hidden <= s->fp8_persistent_rows;
  *programs = persistent ? cap : 0;
  return s->fp8[*recipe][emit_y][with_residual][persistent];
}

Fp8Result fp8_forward_cuda(const at::Tensor& x, const at::Tensor& w, double eps,
                           const std::optional<at::Tensor>& residual, c10::string_view recipe, bool emit_y,
                           double weight_offset) {
  const std::optional<int> index = fp8_recipe(recipe);
  const Signature* s = nullptr;
  int64_t programs = 0;
  if (TVMFFIObjectHandle kernel = served_fp8(x, w, eps, residual, index, emit_y, weight_offset, &s, &programs)) {
    const bool with_residual = residual.has_value() && residual->defined();
    return launch_fp8(x, w, with_residual ? &*residual : nullptr, eps, *index, emit_y, s->hidden, kernel,
                      programs);
  }
  GilScope gil;
  auto outs = call_python_op(python_fp8_op,
                             {THPVariable_Wrap(x), THPVariable_Wrap(w), PyFloat_FromDouble(eps), wrap_optional(residual),
                              PyUnicode_FromStringAndSize(recipe.data(), Py_ssize_t(recipe.size())),
                              PyBool_FromLong(emit_y), PyFloat_FromDouble(weight_offset)},
                             5);
  return {outs[0], outs[1], outs[2], outs[3], outs[4]};
}

// The FP8 op's autograd formula (custom_ops._setup_fp8_context / _fp8_backward): data and scales get no gradient
// either; y's gradient is the norm's.
struct OpFp8Function : public torch::autograd::Function<OpFp8Function> {
  static variable_list forward(AutogradContext* ctx, c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& w,
                               double eps, const std::optional<at::Tensor>& residual, c10::string_view recipe,
                               bool emit_y, double weight_offset) {
    auto [data, scales, y, rstd, h_new] = below_autograd(keys, x, w, eps, residual, recipe, emit_y, weight_offset);
    save_norm_inputs(ctx, {data, scales, rstd}, x, w, rstd, h_new, residual, weight_offset);
    return {data, scales, y, rstd, h_new};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool residual = ctx->saved_data["residual"].toBool();
    const at::Tensor g_residual = residual ? grads[4] : at::Tensor();
    // One gradient per forward argument: (keys, x, w, eps, residual, recipe, emit_y, weight_offset).
    if (!grads[2].defined()) return {{}, g_residual, {}, {}, g_residual, {}, {}, {}};
    auto [dx, dw] = norm_gradients(ctx, grads[2], g_residual, true);
    return {{}, dx, dw, {}, residual ? dx : at::Tensor(), {}, {}, {}};
  }

  static Fp8Result below_autograd(c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& w, double eps,
                                  const std::optional<at::Tensor>& residual, c10::string_view recipe, bool emit_y,
                                  double weight_offset) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return fp8_op().redispatch(keys & c10::after_ADInplaceOrView_keyset, x, w, eps, residual, recipe, emit_y,
                               weight_offset);
  }
};

Fp8Result fp8_forward_autograd_cuda(c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& w, double eps,
                                    const std::optional<at::Tensor>& residual, c10::string_view recipe, bool emit_y,
                                    double weight_offset) {
  if (!records_graph(x, w, residual)) {
    return OpFp8Function::below_autograd(keys, x, w, eps, residual, recipe, emit_y, weight_offset);
  }
  variable_list out = OpFp8Function::apply(keys, x, w, eps, residual, recipe, emit_y, weight_offset);
  return {out[0], out[1], out[2], out[3], out[4]};
}

// Registered once per process; the libraries stay for its lifetime (their destruction would deregister).
torch::Library* op_cuda_kernels = nullptr;
torch::Library* op_autograd_kernels = nullptr;

// ---- the module's functions ----------------------------------------------------------------------

// rmsnorm(x, w, eps, residual, weight_offset): y, (y, h_new), or None (take the Python path).
PyObject* rmsnorm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!check_count(nargs, 5, "rmsnorm")) return nullptr;
  const std::optional<ForwardCall> c = forward_call(args);
  if (!c) Py_RETURN_NONE;
  if (!records_graph(*c->x, *c->w, c->residual)) {  // no graph to record: no node to build
    ForwardOutputs out = launch_forward(*c->signature, *c->x, *c->w, c->residual, c->eps);
    if (c->residual == nullptr) return THPVariable_Wrap(std::move(out.y));
    return tuple_of({out.y, out.h_new});
  }
  std::optional<at::Tensor> residual;
  if (c->residual != nullptr) residual = *c->residual;
  variable_list out = NormFunction::apply(*c->x, *c->w, residual, c->signature, c->eps);
  if (c->residual == nullptr) return THPVariable_Wrap(std::move(out[0]));
  return tuple_of({out[0], out[1]});
  END_HANDLE_TH_ERRORS
}

// forward(x, w, eps, residual, weight_offset): (y, rstd), (y, rstd, h_new), or None.
PyObject* forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!check_count(nargs, 5, "forward")) return nullptr;
  const std::optional<ForwardCall> c = forward_call(args);
  if (!c) Py_RETURN_NONE;
  ForwardOutputs out = launch_forward(*c->signature, *c->x, *c->w, c->residual, c->eps);
  if (c->residual == nullptr) return tuple_of({out.y, out.rstd});
  return tuple_of({out.y, out.rstd, out.h_new});
  END_HANDLE_TH_ERRORS
}

std::optional<at::ScalarType> gradient_dtype(PyObject* obj) {  // fp32, bf16 or fp16
  if (!THPDtype_Check(obj)) return std::nullopt;
  const at::ScalarType t = reinterpret_cast<THPDtype*>(obj)->scalar_type;
  if (t != at::kFloat && t != at::kBFloat16 && t != at::kHalf) return std::nullopt;
  return t;
}

// backward(g, x, w, rstd, g_residual, weight_offset, dw_dtype, deterministic): (dx, dw) or None.
PyObject* backward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!check_count(nargs, 8, "backward")) return nullptr;
  const std::optional<at::ScalarType> dw_dtype = gradient_dtype(args[6]);
  if (!plain_context() || !dw_dtype || (args[7] != Py_True && args[7] != Py_False)) Py_RETURN_NONE;
  const at::Tensor* g = plain_cuda(args[0]);
  const at::Tensor* x = plain_cuda(args[1]);
  const at::Tensor* w = plain_cuda(args[2]);
  const at::Tensor* rstd = plain_cuda(args[3]);
  const bool residual = args[4] != Py_None;
  const at::Tensor* g_residual = residual ? plain_cuda(args[4]) : nullptr;
  if (g == nullptr || x == nullptr || w == nullptr || rstd == nullptr || (residual && g_residual == nullptr)) {
    Py_RETURN_NONE;
  }
  const Signature* s = find_signature(*x, *w, args[5]);
  if (s == nullptr || !like(*g, *x, s->act_align) || (residual && !like(*g_residual, *x, s->act_align)) ||
      rstd->scalar_type() != at::kFloat || rstd->dim() != 1 || rstd->size(0) != x->numel() / s->hidden ||
      rstd->device() != x->device() || !rstd->is_contiguous()) {
    Py_RETURN_NONE;
  }
  auto [dx, dw] = launch_backward(*s, *g, *x, *w, *rstd, residual ? *g_residual : at::Tensor(), *dw_dtype, true);
  return tuple_of({dx, dw});
  END_HANDLE_TH_ERRORS
}

// The signature of (x, w, weight_offset), created with its alignments and planner on first sight. The
// caller holds signatures_mutex exclusively.
Signature& signature_for(const at::Tensor& x, const at::Tensor& w, double weight_offset, long long act_align,
                         long long w_align, PyObject* planner) {
  Signature*& s = signatures[signature_key(x, w, weight_offset)];
  if (s == nullptr) {
    Py_INCREF(planner);
    s = new Signature{x.size(-1), act_align, w_align, {nullptr, nullptr}, {}, planner};
  }
  return *s;
}

// Fills an empty kernel slot (a registered kernel stays: a signature's kernels never change).
void hold(TVMFFIObjectHandle& slot, unsigned long long kernel) {
  if (slot == nullptr) {
    slot = reinterpret_cast<TVMFFIObjectHandle>(kernel);
    TVMFFIObjectIncRef(slot);
  }
}

bool registration_arguments_ok(PyObject* x_obj, PyObject* w_obj, unsigned long long kernel) {
  if (THPVariable_Check(x_obj) && THPVariable_Check(w_obj) && kernel != 0) return true;
  PyErr_SetString(PyExc_TypeError, "register needs tensors x and w and a TVM-FFI function handle");
  return false;
}

// register(x, w, weight_offset, residual, forward_kernel, act_align, w_align, planner): after the Python
// path validated (x, w, weight_offset) and launched the forward kernel (a TVM-FFI function handle).
PyObject* register_signature(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *x_obj, *w_obj, *planner;
  double weight_offset;
  int residual;
  unsigned long long kernel;
  long long act_align, w_align;
  if (!PyArg_ParseTuple(args, "OOdpKLLO", &x_obj, &w_obj, &weight_offset, &residual, &kernel, &act_align,
                        &w_align, &planner) ||
      !registration_arguments_ok(x_obj, w_obj, kernel)) {
    return nullptr;
  }
  std::unique_lock lock(signatures_mutex);
  Signature& s = signature_for(THPVariable_Unpack(x_obj), THPVariable_Unpack(w_obj), weight_offset, act_align,
                               w_align, planner);
  hold(s.forward[residual], kernel);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// register_fp8(x, w, weight_offset, residual, recipe, emit_y, persistent, programs, persistent_rows, kernel,
// act_align, w_align, planner): after the Python path validated and launched the FP8 forward of this recipe,
// emit_y and mode, one-tile or persistent; programs and persistent_rows are the mode's launch rule.
PyObject* register_fp8(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *x_obj, *w_obj, *planner;
  double weight_offset;
  int residual, emit_y, persistent;
  const char* recipe;
  unsigned long long kernel;
  long long programs, persistent_rows, act_align, w_align;
  if (!PyArg_ParseTuple(args, "OOdpsppLLKLLO", &x_obj, &w_obj, &weight_offset, &residual, &recipe, &emit_y,
                        &persistent, &programs, &persistent_rows, &kernel, &act_align, &w_align, &planner) ||
      !registration_arguments_ok(x_obj, w_obj, kernel)) {
    return nullptr;
  }
  const std::optional<int> index = fp8_recipe(recipe);
  if (!index) {
    PyErr_Format(PyExc_ValueError, "register_fp8: unknown recipe %s", recipe);
    return nullptr;
  }
  std::unique_lock lock(signatures_mutex);
  Signature& s = signature_for(THPVariable_Unpack(x_obj), THPVariable_Unpack(w_obj), weight_offset, act_align,
                               w_align, planner);
  hold(s.fp8[*index][emit_y][residual][persistent], kernel);
  s.fp8_programs[residual] = programs;
  s.fp8_persistent_rows = persistent_rows;
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// clear(): forget every signature and plan (after a kernel config override).
PyObject* clear(PyObject*, PyObject*) {
  {
    std::unique_lock lock(signatures_mutex);
    signatures.clear();
  }
  std::lock_guard<std::mutex> lock(plans_mutex);
  plans.clear();
  Py_RETURN_NONE;
}

// install_op_kernels(forward_body, backward_body, backward_parts_body, fp8_forward_body): register the
// kernels above for the CUDA and AutogradCUDA keys of cake_cute::rmsnorm_fwd / rmsnorm_fp8_fwd and the CUDA
// keys of rmsnorm_bwd / rmsnorm_bwd_parts (once), with the ops' Python bodies for what they do not serve.
PyObject* install_op_kernels(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *forward_body, *backward_body, *backward_parts_body, *fp8_forward_body;
  if (!PyArg_ParseTuple(args, "OOOO", &forward_body, &backward_body, &backward_parts_body, &fp8_forward_body)) {
    return nullptr;
  }
  if (op_cuda_kernels == nullptr) {
    for (PyObject* body : {forward_body, backward_body, backward_parts_body, fp8_forward_body}) Py_INCREF(body);
    python_forward_op = forward_body;
    python_backward_op = backward_body;
    python_backward_parts_op = backward_parts_body;
    python_fp8_op = fp8_forward_body;
    op_cuda_kernels = new torch::Library(torch::Library::IMPL, "cake_cute", c10::DispatchKey::CUDA, __FILE__, __LINE__);
    op_cuda_kernels->impl("rmsnorm_fwd", TORCH_FN(forward_cuda));
    op_cuda_kernels->impl("rmsnorm_bwd", TORCH_FN(backward_cuda));
    op_cuda_kernels->impl("rmsnorm_bwd_parts", TORCH_FN(backward_parts_cuda));
    op_cuda_kernels->impl("rmsnorm_fp8_fwd", TORCH_FN(fp8_forward_cuda));
    op_autograd_kernels =
        new torch::Library(torch::Library::IMPL, "cake_cute", c10::DispatchKey::AutogradCUDA, __FILE__, __LINE__);
    op_autograd_kernels->impl("rmsnorm_fwd", TORCH_FN(forward_autograd_cuda));
    op_autograd_kernels->impl("rmsnorm_fp8_fwd", TORCH_FN(fp8_forward_autograd_cuda));
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// signature_count(): how many signatures are registered (for tests).
PyObject* signature_count(PyObject*, PyObject*) {
  std::shared_lock lock(signatures_mutex);
  return PyLong_FromSize_t(signatures.size());
}

PyMethodDef methods[] = {
    {"rmsnorm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rmsnorm)), METH_FASTCALL,
     "rmsnorm(x, w, eps, residual, weight_offset): the autograd call, or None for the Python path"},
    {"forward", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(forward)), METH_FASTCALL,
     "forward(x, w, eps, residual, weight_offset): (y, rstd[, h_new]) or None"},
    {"backward", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(backward)), METH_FASTCALL,
     "backward(g, x, w, rstd, g_residual, weight_offset, dw_dtype, deterministic): (dx, dw) or None"},
    {"register", register_signature, METH_VARARGS,
     "register(x, w, weight_offset, residual, forward_kernel, act_align, w_align, planner)"},
    {"register_fp8", register_fp8, METH_VARARGS,
     "register_fp8(x, w, weight_offset, residual, recipe, emit_y, persistent, programs, persistent_rows, kernel, "
     "act_align, w_align, planner)"},
    {"clear", clear, METH_NOARGS, "forget every registered signature and plan"},
    {"install_op_kernels", install_op_kernels, METH_VARARGS,
     "install_op_kernels(forward_body, backward_body, backward_parts_body, fp8_forward_body): the custom ops' "
     "CUDA and AutogradCUDA kernels"},
    {"signature_count", signature_count, METH_NOARGS, "the number of registered signatures"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "cake_cute_native", "cake_cute's native host path", -1,
                          methods};

// torch's DLPack exchange API: a capsule at torch.Tensor.__dlpack_c_exchange_api__ (the DLPack
// convention), or an address or capsule at __c_dlpack_exchange_api__ (torch releases before it).
const DLPackExchangeAPI* find_torch_dlpack() {
  PyObject* torch = PyImport_ImportModule("torch");
  if (torch == nullptr) return nullptr;
  PyObject* tensor_type = PyObject_GetAttrString(torch, "Tensor");
  Py_DECREF(torch);
  if (tensor_type == nullptr) return nullptr;
  PyObject* api = nullptr;
  for (const char* name : {"__dlpack_c_exchange_api__", "__c_dlpack_exchange_api__"}) {
    api = PyObject_GetAttrString(tensor_type, name);
    if (api != nullptr) break;
    PyErr_Clear();
  }
  Py_DECREF(tensor_type);
  if (api == nullptr) {
    PyErr_SetString(PyExc_ImportError, "torch has no DLPack exchange API (torch.Tensor.__dlpack_c_exchange_api__)");
    return nullptr;
  }
  // The table is static in torch: it outlives the capsule.
  const void* table = PyCapsule_CheckExact(api) ? PyCapsule_GetPointer(api, "dlpack_exchange_api")
                                                : PyLong_AsVoidPtr(api);
  Py_DECREF(api);
  return static_cast<const DLPackExchangeAPI*>(table);
}

}  // namespace

PyMODINIT_FUNC PyInit_cake_cute_native() {
  torch_dlpack = find_torch_dlpack();
  if (torch_dlpack == nullptr) return nullptr;
  if (torch_dlpack->header.version.major != DLPACK_MAJOR_VERSION || torch_dlpack->current_work_stream == nullptr) {
    PyErr_SetString(PyExc_ImportError, "torch's DLPack exchange API has no usable current_work_stream");
    return nullptr;
  }
  return PyModule_Create(&module_def);
}
