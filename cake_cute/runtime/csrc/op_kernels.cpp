// The custom ops' C++ kernels for CUDA tensors (cake_cute::rmsnorm_fwd, rmsnorm_fp8_fwd, rmsnorm_bwd,
// rmsnorm_bwd_parts), installed once the extension is loaded (install_op_kernels).

#include "native.h"

namespace cake_cute_native {

// ---- the custom ops' kernels ---------------------------------------------------------------------
//
// Under torch.compile (and wherever else `cake_cute::rmsnorm_fwd` / `rmsnorm_bwd` / `rmsnorm_bwd_parts` /
// `rmsnorm_fp8_fwd` are called) every call goes through the dispatcher. With Python kernels there, each call
// pays torch.library's Python autograd layer and a Python backend kernel, the largest host cost of a
// compiled step. Once the extension is loaded these C++ kernels
// take the CUDA keys: the CUDA kernels launch served signatures directly and hand every other call to
// the op's Python body; the AutogradCUDA kernel redispatches below autograd when there is no graph to
// record (a compiled graph's case) and otherwise records a C++ node whose backward calls `rmsnorm_bwd`,
// as the Python registration does for the other devices (`library_ops._setup_context` / `_backward`).


PyObject* python_forward_op = nullptr;   // library_ops.rmsnorm_fwd: every call these kernels do not serve
PyObject* python_backward_op = nullptr;  // library_ops.rmsnorm_bwd
PyObject* python_backward_parts_op = nullptr;  // library_ops.rmsnorm_bwd_parts
PyObject* python_fp8_op = nullptr;             // library_ops.rmsnorm_fp8_fwd
PyObject* python_differentiable_backward = nullptr;  // reference.differentiable_backward

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

// Calls a Python op body with (tensors..., optional tensor, weight_offset) in the schema's
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
                           const std::optional<at::Tensor>& residual, double weight_offset) {
  const bool with_residual = residual.has_value() && residual->defined();
  const Signature* s = validated_eps(eps) && x.layout() == at::kStrided ? find_signature(x, w, weight_offset) : nullptr;
  if (s != nullptr && s->forward[with_residual] != nullptr && (!with_residual || like(*residual, x, s->act_align))) {
    ForwardOutputs out = launch_forward(*s, x, w, with_residual ? &*residual : nullptr, eps, true);
    if (!with_residual) out.h_new = at::empty({0}, x.options());
    return {std::move(out.y), std::move(out.rstd), std::move(out.h_new)};
  }
  GilScope gil;
  auto outs = call_python_op(python_forward_op,
                             {THPVariable_Wrap(x), THPVariable_Wrap(w), PyFloat_FromDouble(eps), wrap_optional(residual),
                              PyFloat_FromDouble(weight_offset)},
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
                             const std::optional<at::Tensor>& g_residual, double weight_offset) {
  if (const Signature* s = served_backward({g}, x, w, rstd, g_residual, weight_offset)) {
    auto [dx, dw] = launch_backward(*s, g, x, w, rstd, optional_or_undefined(g_residual), w.scalar_type(), true);
    return {std::move(dx), std::move(dw)};
  }
  GilScope gil;
  auto outs = call_python_op(python_backward_op,
                             {THPVariable_Wrap(g), THPVariable_Wrap(x), THPVariable_Wrap(w), THPVariable_Wrap(rstd),
                              wrap_optional(g_residual), PyFloat_FromDouble(weight_offset)},
                             2);
  return {outs[0], outs[1]};
}

// rmsnorm_bwd_parts: g given as its 2-3 summands (cake_cute.graph_passes puts it in compiled graphs).
BackwardResult backward_parts_cuda(at::TensorList g, const at::Tensor& x, const at::Tensor& w, const at::Tensor& rstd,
                                   const std::optional<at::Tensor>& g_residual, double weight_offset) {
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
                              wrap_optional(g_residual), PyFloat_FromDouble(weight_offset)},
                             2);
  return {outs[0], outs[1]};
}

bool records_second_order(std::initializer_list<at::Tensor> tensors) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.requires_grad()) return true;
  }
  return false;
}

std::tuple<at::Tensor, at::Tensor> differentiable_gradients(const at::Tensor& g, const at::Tensor& h,
                                                            const at::Tensor& w, double eps,
                                                            const at::Tensor& g_residual, double weight_offset) {
  GilScope gil;
  std::optional<at::Tensor> g_res;
  if (g_residual.defined()) g_res = g_residual;
  auto outs = call_python_op(python_differentiable_backward,
                             {THPVariable_Wrap(g), THPVariable_Wrap(h), THPVariable_Wrap(w), PyFloat_FromDouble(eps),
                              wrap_optional(g_res), PyFloat_FromDouble(weight_offset)},
                             2);
  return {outs[0], outs[1]};
}

// What both forward ops' autograd nodes save: (x or h_new, w, rstd), the mode, eps and the offset; the
// outputs in `non_differentiable`, and h_new in plain mode, get no gradient; an unused output's stays
// undefined.
void save_norm_inputs(AutogradContext* ctx, std::vector<at::Tensor> non_differentiable, const at::Tensor& x,
                      const at::Tensor& w, const at::Tensor& rstd, const at::Tensor& h_new,
                      const std::optional<at::Tensor>& residual, double eps, double weight_offset) {
  const bool with_residual = residual.has_value() && residual->defined();
  ctx->set_materialize_grads(false);
  if (!with_residual) non_differentiable.push_back(h_new);
  ctx->mark_non_differentiable(non_differentiable);
  ctx->save_for_backward(norm_saved_tensors(x, w, rstd, h_new, with_residual));
  ctx->saved_data["residual"] = with_residual;
  ctx->saved_data["eps"] = eps;
  ctx->saved_data["weight_offset"] = weight_offset;
}

// (dx, dw) of a node saved by save_norm_inputs, from y's gradient `g` (defined) and, in residual mode,
// h_new's (undefined when h_new was unused): rmsnorm_bwd on the saved tensors, or the differentiable
// formula when the backward records a graph (double backward).
std::tuple<at::Tensor, at::Tensor> norm_gradients(AutogradContext* ctx, const at::Tensor& g,
                                                  const at::Tensor& g_residual) {
  const variable_list saved = ctx->get_saved_variables();
  const bool residual = ctx->saved_data["residual"].toBool();
  const double weight_offset = ctx->saved_data["weight_offset"].toDouble();
  const at::Tensor g_res_or_undefined = residual ? g_residual : at::Tensor();
  if (records_second_order({g, saved[0], saved[1], g_res_or_undefined})) {
    return differentiable_gradients(g, saved[0], saved[1], ctx->saved_data["eps"].toDouble(), g_res_or_undefined,
                                    weight_offset);
  }
  std::optional<at::Tensor> g_res;
  if (residual) g_res = g_residual;
  return backward_op().call(g, saved[0], saved[1], saved[2], g_res, weight_offset);
}

// The op's autograd formula: one dx is the gradient of x and residual.
struct OpNormFunction : public torch::autograd::Function<OpNormFunction> {
  static variable_list forward(AutogradContext* ctx, c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& w,
                               double eps, const std::optional<at::Tensor>& residual, double weight_offset) {
    auto [y, rstd, h_new] = below_autograd(keys, x, w, eps, residual, weight_offset);
    save_norm_inputs(ctx, {rstd}, x, w, rstd, h_new, residual, eps, weight_offset);
    return {y, rstd, h_new};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool residual = ctx->saved_data["residual"].toBool();
    const at::Tensor g_residual = residual ? grads[2] : at::Tensor();
    // One gradient per forward argument: (keys, x, w, eps, residual, weight_offset).
    if (!grads[0].defined()) return {{}, g_residual, {}, {}, g_residual, {}};
    auto [dx, dw] = norm_gradients(ctx, grads[0], g_residual);
    return {{}, dx, dw, {}, residual ? dx : at::Tensor(), {}};
  }

  static ForwardResult below_autograd(c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& w, double eps,
                                      const std::optional<at::Tensor>& residual, double weight_offset) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return forward_op().redispatch(keys & c10::after_ADInplaceOrView_keyset, x, w, eps, residual, weight_offset);
  }
};

ForwardResult forward_autograd_cuda(c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& w, double eps,
                                    const std::optional<at::Tensor>& residual, double weight_offset) {
  if (!records_graph(x, w, residual)) {
    return OpNormFunction::below_autograd(keys, x, w, eps, residual, weight_offset);
  }
  variable_list out = OpNormFunction::apply(keys, x, w, eps, residual, weight_offset);
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
  if (!recipe || !validated_eps(eps) || x.layout() != at::kStrided) return nullptr;
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

// The FP8 op's autograd formula (library_ops._setup_fp8_context / fp8_backward): data and scales get no gradient
// either; y's gradient is the norm's.
struct OpFp8Function : public torch::autograd::Function<OpFp8Function> {
  static variable_list forward(AutogradContext* ctx, c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& w,
                               double eps, const std::optional<at::Tensor>& residual, c10::string_view recipe,
                               bool emit_y, double weight_offset) {
    auto [data, scales, y, rstd, h_new] = below_autograd(keys, x, w, eps, residual, recipe, emit_y, weight_offset);
    save_norm_inputs(ctx, {data, scales, rstd}, x, w, rstd, h_new, residual, eps, weight_offset);
    return {data, scales, y, rstd, h_new};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool residual = ctx->saved_data["residual"].toBool();
    const at::Tensor g_residual = residual ? grads[4] : at::Tensor();
    // One gradient per forward argument: (keys, x, w, eps, residual, recipe, emit_y, weight_offset).
    if (!grads[2].defined()) return {{}, g_residual, {}, {}, g_residual, {}, {}, {}};
    auto [dx, dw] = norm_gradients(ctx, grads[2], g_residual);
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

// install_op_kernels(forward_body, backward_body, backward_parts_body, fp8_forward_body,
// differentiable_backward): register the kernels above for the CUDA and AutogradCUDA keys of
// cake_cute::rmsnorm_fwd / rmsnorm_fp8_fwd and the CUDA keys of rmsnorm_bwd / rmsnorm_bwd_parts (once), with
// the ops' Python bodies for what they do not serve and the backward's differentiable formula.
PyObject* install_op_kernels(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *forward_body, *backward_body, *backward_parts_body, *fp8_forward_body, *differentiable_backward;
  if (!PyArg_ParseTuple(args, "OOOOO", &forward_body, &backward_body, &backward_parts_body, &fp8_forward_body,
                        &differentiable_backward)) {
    return nullptr;
  }
  if (op_cuda_kernels == nullptr) {
    for (PyObject* body : {forward_body, backward_body, backward_parts_body, fp8_forward_body, differentiable_backward}) {
      Py_INCREF(body);
    }
    python_differentiable_backward = differentiable_backward;
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

}  // namespace cake_cute_native
