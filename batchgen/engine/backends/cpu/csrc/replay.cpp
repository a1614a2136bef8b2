// A recorded forward's ops run from C++ (executor/op_replay.py's steps): each op's handle and its full argument
// stack are resolved once, so a replay makes one boxed dispatcher call an op with no Python between them (about a
// microsecond less an op than the same loop in Python; a one-row SmolLM2 step runs 275 ops), optionally with a
// clock read around each (the profiler's timed replays: tens of nanoseconds an op).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <chrono>
#include <string>
#include <vector>

namespace batchgen_cpu {
namespace {

// Python hands lists of tensors over as Tensor[]; an op that takes Tensor?[] (aten::index) needs them as such.
c10::IValue as_argument(c10::IValue value, const c10::Argument& arg, const std::string& op) {
  const c10::TypePtr& want = arg.type();  // SymInt as int: the ints Python passes
  if (value.isTensorList() && want->kind() == c10::TypeKind::ListType &&
      want->containedType(0)->kind() == c10::TypeKind::OptionalType) {
    c10::List<std::optional<at::Tensor>> optional;
    for (const at::Tensor& t : value.toTensorList()) optional.push_back(t);
    value = std::move(optional);
  }
  c10::TypePtr base = want;
  if (auto optional = want->cast<c10::OptionalType>()) base = optional->getElementType();
  if (value.isInt() && base->kind() == c10::TypeKind::FloatType) value = static_cast<double>(value.toInt());
  // Python's dtypes, layouts and memory formats arrive as ints, as the ops' unboxing takes them.
  const auto kind = base->kind();
  const bool enum_as_int = value.isInt() && (kind == c10::TypeKind::ScalarTypeType ||
                                             kind == c10::TypeKind::LayoutType ||
                                             kind == c10::TypeKind::MemoryFormatType);
  TORCH_CHECK(value.isNone() || enum_as_int || value.type()->isSubtypeOf(*want), op, "'s argument ", arg.name(),
              " is ", value.type()->str(), ", not ", want->str());
  return value;
}

struct OpProgram : torch::CustomClassHolder {
  struct Step {
    c10::OperatorHandle op;
    std::vector<c10::IValue> args;   // every argument of the schema, in its order
    std::vector<at::Tensor> copies;  // where the op's returned tensors go (ops without an out= overload), or none
  };
  std::vector<Step> steps;

  void add(const std::string& name, const std::string& overload, const c10::List<c10::IValue>& args,
           std::vector<at::Tensor> copies) {
    const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const std::vector<c10::Argument>& schema = op.schema().arguments();
    TORCH_CHECK(args.size() == schema.size(), name, " takes ", schema.size(), " arguments, got ", args.size());
    std::vector<c10::IValue> stack;
    stack.reserve(args.size());
    for (size_t i = 0; i < args.size(); ++i) stack.push_back(as_argument(args.get(i), schema[i], name));
    steps.push_back({op, std::move(stack), std::move(copies)});
  }

  // Runs every step; with `seconds`, each step's wall time (its copies included) goes into seconds[step].
  void run(std::vector<double>* seconds = nullptr) const {
    c10::InferenceMode guard;  // as the recording ran (its tensors are inference tensors)
    torch::jit::Stack stack;
    for (size_t s = 0; s < steps.size(); ++s) {
      const Step& step = steps[s];
      const auto start = seconds ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
      stack.assign(step.args.begin(), step.args.end());
      step.op.callBoxed(stack);
      copy_returns(step, stack);
      if (seconds) (*seconds)[s] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
  }

  static void copy_returns(const Step& step, const torch::jit::Stack& stack) {
    if (step.copies.empty()) return;
    size_t i = 0;
    auto copy = [&](const at::Tensor& t) {
      TORCH_CHECK(i < step.copies.size(), step.op.schema().name(), " returned more tensors than recorded");
      step.copies[i++].copy_(t);
    };
    for (const c10::IValue& value : stack) {
      if (value.isTensor()) copy(value.toTensor());
      else if (value.isTensorList()) for (const at::Tensor& t : value.toTensorList()) copy(t);
    }
    TORCH_CHECK(i == step.copies.size(), step.op.schema().name(), " returned fewer tensors than recorded");
  }
};

void run_program(const c10::intrusive_ptr<OpProgram>& program) { program->run(); }

std::vector<double> run_program_timed(const c10::intrusive_ptr<OpProgram>& program) {
  std::vector<double> seconds(program->steps.size());
  program->run(&seconds);
  return seconds;
}

}  // namespace
}  // namespace batchgen_cpu

TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m) {
  m.class_<batchgen_cpu::OpProgram>("OpProgram")
      .def(torch::init<>())
      .def("add", &batchgen_cpu::OpProgram::add);
  m.def("run_program(__torch__.torch.classes.batchgen_cpu.OpProgram program) -> ()", &batchgen_cpu::run_program);
  m.def("run_program_timed(__torch__.torch.classes.batchgen_cpu.OpProgram program) -> float[]",
        &batchgen_cpu::run_program_timed);
}
