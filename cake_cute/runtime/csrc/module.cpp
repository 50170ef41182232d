// The module cake_cute_native: the eager autograd node, the functions Python calls (the served calls,
// registration, clear, counts) and the module's initialization.

#include "native.h"

namespace cake_cute_native {

// ---- the autograd node ---------------------------------------------------------------------------

// Saves exactly (x or h_new, w, rstd), like CakeRMSNormFunction; unused gradients stay undefined.
struct NormFunction : public torch::autograd::Function<NormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                               const std::optional<at::Tensor>& residual, const Signature* s, double eps) {
    ForwardOutputs out = launch_forward(*s, x, w, residual ? &*residual : nullptr, eps);
    ctx->set_materialize_grads(false);
    ctx->saved_data["signature"] = reinterpret_cast<int64_t>(s);
    ctx->saved_data["eps"] = eps;
    ctx->save_for_backward(norm_saved_tensors(x, w, out.rstd, out.h_new, residual.has_value()));
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
    if (records_second_order({grads[0], saved[0], w, g_residual})) {
      auto [dx, dw] = differentiable_gradients(grads[0], saved[0], w, ctx->saved_data["eps"].toDouble(), g_residual,
                                               s->weight_offset);
      return {dx, dw, residual ? dx : at::Tensor(), {}, {}};
    }
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

// backward(g, x, w, rstd, g_residual, weight_offset, dw_dtype): (dx, dw) or None.
PyObject* backward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!check_count(nargs, 7, "backward")) return nullptr;
  const std::optional<at::ScalarType> dw_dtype = gradient_dtype(args[6]);
  if (!plain_context() || !dw_dtype) Py_RETURN_NONE;
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
    s = new Signature{x.size(-1), weight_offset, act_align, w_align, {nullptr, nullptr}, {}, planner};
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

// accept_eps(eps): an eps the Python path has just validated; calls with it may take this path.
PyObject* accept_eps_value(PyObject*, PyObject* eps) {
  const double value = PyFloat_AsDouble(eps);
  if (value == -1.0 && PyErr_Occurred()) return nullptr;
  accept_eps(value);
  Py_RETURN_NONE;
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
     "backward(g, x, w, rstd, g_residual, weight_offset, dw_dtype): (dx, dw) or None"},
    {"register", register_signature, METH_VARARGS,
     "register(x, w, weight_offset, residual, forward_kernel, act_align, w_align, planner)"},
    {"register_fp8", register_fp8, METH_VARARGS,
     "register_fp8(x, w, weight_offset, residual, recipe, emit_y, persistent, programs, persistent_rows, kernel, "
     "act_align, w_align, planner)"},
    {"accept_eps", accept_eps_value, METH_O, "accept_eps(eps): an eps the Python path validated"},
    {"clear", clear, METH_NOARGS, "forget every registered signature and plan"},
    {"install_op_kernels", install_op_kernels, METH_VARARGS,
     "install_op_kernels(forward_body, backward_body, backward_parts_body, fp8_forward_body, "
     "differentiable_backward): the custom ops' "
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

}  // namespace cake_cute_native

using cake_cute_native::module_def;
using cake_cute_native::find_torch_dlpack;
using cake_cute_native::torch_dlpack;

PyMODINIT_FUNC PyInit_cake_cute_native() {
  torch_dlpack = find_torch_dlpack();
  if (torch_dlpack == nullptr) return nullptr;
  if (torch_dlpack->header.version.major != DLPACK_MAJOR_VERSION || torch_dlpack->current_work_stream == nullptr) {
    PyErr_SetString(PyExc_ImportError, "torch's DLPack exchange API has no usable current_work_stream");
    return nullptr;
  }
  return PyModule_Create(&module_def);
}
