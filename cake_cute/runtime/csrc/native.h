// cake_cute's native host path: the eager autograd node and the functional forward and backward of
// RMSNorm in C++, launching the compiled CuTe kernels through TVM-FFI's C ABI (TVMFFIFunctionCall)
// with DLTensor arguments built on the stack. This header holds what its sources share; they are
//   launch.cpp      the TVM-FFI calls and the launches (forward, forward to FP8, backward);
//   serve.cpp       what a call must be for this path to serve it (the rest takes the Python path);
//   op_kernels.cpp  the custom ops' CUDA and AutogradCUDA kernels;
//   module.cpp      the eager autograd node, the module's functions and its initialization.
// cake_cute/runtime/native.py compiles them into one extension (its build hash covers every file here).
//
// Python stays the authority on what is valid. A call is served here only when
//   * its (x, w, weight_offset) signature was validated and registered by the Python path
//     (cake_cute/runtime/native.py registers it after the Python path launched it once), and
//   * it has the plain layout the kernels read in place: CUDA tensors that are contiguous and
//     vector-aligned, with no tensor subclass, torch function or dispatch mode, functorch wrapper,
//     conjugate / negative / zero view, and at least one row.
// Anything else answers None and the caller takes the Python path, which raises the named error
// (cake_cute/validation.py, the one place that validates) before any launch and handles views, copies
// and caller-owned outputs. The checks here guard memory safety (a layout, length, device and alignment
// the compiled kernels can read in place) or decline what Python would refuse; none raises. The
// backward's launch plan (kernels, programs, FP32 partial rows of dW) also comes from Python, asked
// once per (signature, T, residual, dw dtype) and cached here, so the kernels and the plan are
// exactly those the Python path launches with.
//
// Outputs come from torch's caching allocator (CUDA-graph capture works) and every kernel runs on
// torch's current stream, set as TVM-FFI's environment stream around the call (the kernels read it
// from there). A backward that sums dW in its own launch takes its grid barrier's counter as the
// Python path does (views.barrier_counter): one per (device, stream), zeroed once and left zero by
// every launch, or a fresh zeroed one while the stream is captured into a CUDA graph. Building needs
// torch's and TVM-FFI's headers and libraries only: the stream comes through torch's DLPack exchange
// API and the capture state from the driver's cuStreamIsCapturing, looked up at run time, so neither
// CUDA headers nor libc10_cuda are involved.
//
// Which path a call takes is decided in Python (cake_cute/routing.py); this side serves what Python
// registered, with the launch plans Python handed over (the backward's through the planner, the FP8
// forward's persistent rule as numbers at registration), and declines everything else.

#pragma once

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

#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace cake_cute_native {

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
  double weight_offset;
  int64_t act_align, w_align;  // byte alignment the kernels assume for rows of x and for w
  TVMFFIObjectHandle forward[2] = {nullptr, nullptr};  // plain, residual; null until registered
  TVMFFIObjectHandle fp8[2][2][2][2] = {};  // [recipe: mxfp8, 1x128][emit_y][residual][persistent]
  // Python: (rows, residual, dw_dtype, g_parts) -> (bwd, dw or 0, programs, partial_rows, stride, dw_in_launch)
  PyObject* planner;
  // The FP8 forward's launch rule as Python hands it over (launch_plan.fp8_forward_rule): up to fp8_persistent_rows
  // rows the persistent kernel runs at most fp8_programs[residual] programs (0: never persistent).
  int64_t fp8_programs[2] = {0, 0};
  int64_t fp8_persistent_rows = 0;
};

// Signatures are never freed: a clear (a config override in tests and tuning) only forgets them, so an
// autograd graph recorded before it still runs its backward. Written under the GIL; the custom ops'
// kernels read it without the GIL (the dispatcher is entered with it released), hence the lock.
inline std::unordered_map<SignatureKey, Signature*, SignatureKeyHash> signatures;
inline std::shared_mutex signatures_mutex;

struct Plan {  // one backward call shape, as the Python path plans it
  TVMFFIObjectHandle bwd, dw;  // dw: the separate reduction, null when the backward sums dW itself
  int64_t programs, partial_rows, row_stride;
  bool dw_in_launch;
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
inline constexpr size_t kMaxPlans = 4096;
inline constexpr int64_t kMaxGParts = 3;  // g's summands at most (validation.MAX_GRADIENT_PARTS)
inline std::mutex plans_mutex;
inline std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;

inline const DLPackExchangeAPI* torch_dlpack = nullptr;  // torch's, for its current stream

struct TensorArg {  // a DLTensor with its shape and strides, on the caller's stack
  DLTensor dl;
  int64_t shape[2];
  int64_t strides[2];
};

struct ForwardOutputs {
  at::Tensor y, rstd, h_new;  // h_new undefined in plain mode
};

using Fp8Result = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

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

struct ForwardCall {
  const at::Tensor *x, *w, *residual;
  const Signature* signature;
  double eps;
};

using ForwardResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using ForwardSchema = ForwardResult(const at::Tensor&, const at::Tensor&, double, const std::optional<at::Tensor>&,
                                    double);
using BackwardResult = std::tuple<at::Tensor, at::Tensor>;
using BackwardSchema = BackwardResult(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const std::optional<at::Tensor>&, double);

// What every norm autograd node saves (NormFunction, OpNormFunction, OpFp8Function): exactly (x or h_new, w,
// rstd), the rule cake_cute/library_ops.py states once (save_for_backward); tests/test_gpu_native.py checks
// the nodes against the Python Function bit for bit.
inline variable_list norm_saved_tensors(const at::Tensor& x, const at::Tensor& w, const at::Tensor& rstd,
                                        const at::Tensor& h_new, bool residual) {
  return {residual ? h_new : x, w, rstd};
}

// ---- launch.cpp ---------------------------------------------------------------------------------------

// rstd is `[rows]`, or x's shape without its last dimension when `row_shaped_rstd` (the custom op's form).
ForwardOutputs launch_forward(const Signature& s, const at::Tensor& x, const at::Tensor& w,
                              const at::Tensor* residual, double eps, bool row_shaped_rstd = false);
std::optional<int> fp8_recipe(c10::string_view recipe);
Fp8Result launch_fp8(const at::Tensor& x, const at::Tensor& w, const at::Tensor* residual, double eps, int recipe,
                     bool emit_y, int64_t hidden, TVMFFIObjectHandle kernel, int64_t programs);
std::pair<at::Tensor, at::Tensor> launch_backward(const Signature& s, const at::Tensor& g, const at::Tensor& h,
                                                  const at::Tensor& w, const at::Tensor& rstd,
                                                  const at::Tensor& g_residual, at::ScalarType dw_dtype,
                                                  bool want_dw, at::TensorList more_g = {});

// ---- serve.cpp ----------------------------------------------------------------------------------------

bool plain_context();
const at::Tensor* plain_cuda(PyObject* obj);
bool like(const at::Tensor& t, const at::Tensor& x, int64_t align);
bool validated_eps(double eps);
void accept_eps(double eps);
SignatureKey signature_key(const at::Tensor& x, const at::Tensor& w, double weight_offset);
const Signature* find_signature(const at::Tensor& x, const at::Tensor& w, double weight_offset);
const Signature* find_signature(const at::Tensor& x, const at::Tensor& w, PyObject* weight_offset);
std::optional<ForwardCall> forward_call(PyObject* const* args);
bool records_graph(const at::Tensor& x, const at::Tensor& w, const at::Tensor* residual);
bool records_graph(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& residual);

// ---- op_kernels.cpp -----------------------------------------------------------------------------------

PyObject* install_op_kernels(PyObject*, PyObject* args);

// ---- double backward (op_kernels.cpp) -------------------------------------------------------------

// Whether a node's backward must record a graph of its own: create_graph=True (grad mode is on inside a
// backward only then) and one of `tensors` (its saved tensors, its incoming gradients) is in a graph.
bool records_second_order(std::initializer_list<at::Tensor> tensors);
// (dx, dw) by the backward's differentiable formula in Python (reference.differentiable_backward), for a
// backward that records a graph; g_residual undefined in plain mode.
std::tuple<at::Tensor, at::Tensor> differentiable_gradients(const at::Tensor& g, const at::Tensor& h,
                                                            const at::Tensor& w, double eps,
                                                            const at::Tensor& g_residual, double weight_offset);

}  // namespace cake_cute_native
