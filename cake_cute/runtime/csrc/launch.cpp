// The TVM-FFI calls and the launches: the forward, the forward to FP8 and the backward, with the launch
// plans Python handed over (native.h).

#include "native.h"

#include <dlfcn.h>

namespace cake_cute_native {

// ---- TVM-FFI calls ----------------------------------------------------------------------------

DLDataType dl_dtype(at::ScalarType t) {
  if (t == at::kBFloat16) return {kDLBfloat, 16, 1};
  if (t == at::kByte) return {kDLUInt, 8, 1};  // e4m3 data and E8M0 scales, passed as their bytes
  if (t == at::kInt) return {kDLInt, 32, 1};   // the grid barrier's counter
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
    if (torch_dlpack->current_work_stream(kDLCUDA, device_, &stream_) != 0) {
      throw std::runtime_error("cake_cute: torch gave no current CUDA stream");
    }
    if (TVMFFIEnvSetStream(kDLCUDA, device_, stream_, &previous_) != 0) throw_ffi_error("TVMFFIEnvSetStream");
  }
  ~LaunchScope() { TVMFFIEnvSetStream(kDLCUDA, device_, previous_, nullptr); }
  LaunchScope(const LaunchScope&) = delete;
  LaunchScope& operator=(const LaunchScope&) = delete;
  void* stream() const { return stream_; }

 private:
  c10::DeviceGuard guard_;
  int32_t device_;
  void* stream_ = nullptr;
  TVMFFIStreamHandle previous_ = nullptr;
};

// ---- the grid barrier's counters --------------------------------------------------------------

// cuStreamIsCapturing of the driver torch has loaded; null when it cannot be found (then every launch
// gets a fresh zeroed counter, which is always correct).
using IsCapturing = int (*)(void* stream, int* status);
IsCapturing stream_is_capturing() {
  static const IsCapturing fn = [] {
    void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return driver == nullptr ? nullptr : reinterpret_cast<IsCapturing>(dlsym(driver, "cuStreamIsCapturing"));
  }();
  return fn;
}

struct StreamKey {
  c10::DeviceIndex device;
  void* stream;
  bool operator==(const StreamKey&) const = default;
};

struct StreamKeyHash {
  size_t operator()(const StreamKey& k) const { return std::hash<void*>()(k.stream) ^ size_t(k.device); }
};

std::mutex counters_mutex;
std::unordered_map<StreamKey, at::Tensor, StreamKeyHash> counters;  // kept: captured graphs hold them

// One Int32, zero between launches (kernels/dw_finish.py): the stream's own, zeroed once and left zero
// by the launches the stream runs one after another; a stream being captured gets a fresh one, zeroed by
// every replay of the graph.
at::Tensor barrier_counter(const at::Device& device, void* stream) {
  int status = 1;
  const IsCapturing is_capturing = stream_is_capturing();
  const at::TensorOptions options = at::TensorOptions().dtype(at::kInt).device(device);
  if (is_capturing == nullptr || is_capturing(stream, &status) != 0 || status != 0) return at::zeros({1}, options);
  std::lock_guard<std::mutex> lock(counters_mutex);
  auto [slot, fresh] = counters.try_emplace(StreamKey{device.index(), stream});
  if (fresh) slot->second = at::zeros({1}, options);
  return slot->second;
}

ForwardOutputs launch_forward(const Signature& s, const at::Tensor& x, const at::Tensor& w,
                              const at::Tensor* residual, double eps, bool row_shaped_rstd) {
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

// The op's outputs, as library_ops.rmsnorm_fp8_fwd returns them: e4m3 data in x's shape, compact scales
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
    int in_launch = 0;
    const bool parsed = answer != nullptr && PyArg_ParseTuple(answer, "KKLLLp", &bwd, &reduce, &programs,
                                                              &partial_rows, &row_stride, &in_launch);
    Py_XDECREF(answer);
    if (!parsed) {
      python_error error;  // the planner's exception, re-raised where the backward was called
      error.persist();
      throw error;
    }
    plan = {reinterpret_cast<TVMFFIObjectHandle>(bwd), reinterpret_cast<TVMFFIObjectHandle>(reduce), programs,
            partial_rows, row_stride, in_launch != 0};
    // Taken while the GIL keeps Python's kernel objects alive, and held for the process: a cleared plan
    // may still be in use by another thread's launch.
    TVMFFIObjectIncRef(plan.bwd);
    if (plan.dw != nullptr) TVMFFIObjectIncRef(plan.dw);
  }
  std::lock_guard<std::mutex> lock(plans_mutex);
  if (plans.size() >= kMaxPlans) plans.clear();
  plans.emplace(key, plan);
  return plan;
}

// dx (x's shape) and, when `want_dw`, dw in `dw_dtype`; g_residual undefined in plain mode. `more_g`: g's
// other summands (rmsnorm_bwd_parts), in summation order after `g`. A backward that sums dW in its own
// launch writes dw either way.
std::pair<at::Tensor, at::Tensor> launch_backward(const Signature& s, const at::Tensor& g, const at::Tensor& h,
                                                  const at::Tensor& w, const at::Tensor& rstd,
                                                  const at::Tensor& g_residual, at::ScalarType dw_dtype,
                                                  bool want_dw, at::TensorList more_g) {
  const int64_t rows = h.numel() / s.hidden;
  const bool residual = g_residual.defined();
  const Plan plan = backward_plan(s, rows, residual, dw_dtype, 1 + int64_t(more_g.size()));
  at::Tensor dx = at::empty(h.sizes(), h.options());
  at::Tensor partials = at::empty({plan.partial_rows * plan.row_stride}, h.options().dtype(at::kFloat));
  at::Tensor dw = want_dw || plan.dw_in_launch ? at::empty({s.hidden}, w.options().dtype(dw_dtype)) : at::Tensor();
  LaunchScope scope(h.device());
  const at::Tensor counter = plan.dw_in_launch ? barrier_counter(h.device(), scope.stream()) : at::Tensor();
  TensorArg ga, ha, wa, ra, gra, dxa, pa, dwa, ca, more[kMaxGParts - 1];
  const TVMFFIAny partials_arg = tensor_arg(pa, partials, 2, plan.partial_rows, s.hidden, plan.row_stride);
  TVMFFIAny args[10 + kMaxGParts - 1] = {
      matrix(ga, g, rows, s.hidden),
      matrix(ha, h, rows, s.hidden),
      vector(wa, w, s.hidden),
      vector(ra, rstd, rows),
      residual ? matrix(gra, g_residual, rows, s.hidden) : none(),
      matrix(dxa, dx, rows, s.hidden),
      partials_arg,
  };
  int32_t count = 7;
  if (plan.dw_in_launch) {
    args[count++] = vector(dwa, dw, s.hidden);
    args[count++] = vector(ca, counter, 1);
  }
  args[count++] = integer(plan.programs);
  for (size_t i = 0; i < more_g.size(); ++i) args[count++] = matrix(more[i], more_g[i], rows, s.hidden);
  call(plan.bwd, args, count, "the backward kernel");
  if (want_dw && !plan.dw_in_launch) {
    TVMFFIAny reduce_args[] = {partials_arg, vector(dwa, dw, s.hidden)};
    call(plan.dw, reduce_args, 2, "the dW reduction");
  }
  return {dx, want_dw ? dw : at::Tensor()};
}

}  // namespace cake_cute_native
