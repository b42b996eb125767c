// Runs an AOTInductor package (rocs.aoti_package of a portable program) from C++, without
// Python: the smallest serving loop around torch::inductor::AOTIModelPackageLoader.
//
//   aoti_run PACKAGE.pt2 INPUTS.txt OUTPUT_DIR
//
// INPUTS.txt lists the program's flat inputs in call order (the model's arguments, then
// candidate_to_request), one per line: "FILE DTYPE NDIM D0 D1 ...", FILE holding the tensor's
// values as raw little-endian bytes in row-major order; DTYPE is float32, float64, int64, int32
// or bool. Each output i is written to OUTPUT_DIR/out_i.bin in the same form and described in
// OUTPUT_DIR/outputs.txt. A refused call (a check inside the program: an index out of range,
// replicated request rows) prints "error: MESSAGE" and exits with status 1.
//
// Build (see docs/deploy.md):
//   g++ -std=c++20 -O2 aoti_run.cpp -I$TORCH/include -I$TORCH/include/torch/csrc/api/include \
//       -L$TORCH/lib -Wl,-rpath,$TORCH/lib -ltorch -ltorch_cpu -lc10 -o aoti_run

#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

const std::map<std::string, at::ScalarType>& dtypes() {
  static const std::map<std::string, at::ScalarType> table = {
      {"float32", at::kFloat}, {"float64", at::kDouble}, {"int64", at::kLong},
      {"int32", at::kInt},     {"bool", at::kBool},
  };
  return table;
}

std::string dtype_name(at::ScalarType type) {
  for (const auto& [name, value] : dtypes()) {
    if (value == type) return name;
  }
  throw std::runtime_error("output of an unsupported dtype");
}

at::Tensor read_tensor(const std::string& line) {
  std::istringstream fields(line);
  std::string file, dtype;
  int64_t ndim = 0;
  fields >> file >> dtype >> ndim;
  auto type = dtypes().find(dtype);
  if (type == dtypes().end()) throw std::runtime_error("unknown dtype " + dtype);
  std::vector<int64_t> shape(ndim);
  for (auto& size : shape) fields >> size;
  at::Tensor tensor = at::empty(shape, at::TensorOptions().dtype(type->second));
  std::ifstream in(file, std::ios::binary);
  in.read(static_cast<char*>(tensor.data_ptr()), tensor.nbytes());
  if (!in) throw std::runtime_error("could not read " + file);
  return tensor;
}

void write_tensor(const at::Tensor& value, const std::string& dir, size_t i, std::ostream& list) {
  at::Tensor tensor = value.contiguous();
  std::string file = dir + "/out_" + std::to_string(i) + ".bin";
  std::ofstream out(file, std::ios::binary);
  out.write(static_cast<const char*>(tensor.data_ptr()), tensor.nbytes());
  list << file << " " << dtype_name(tensor.scalar_type()) << " " << tensor.dim();
  for (auto size : tensor.sizes()) list << " " << size;
  list << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: aoti_run PACKAGE.pt2 INPUTS.txt OUTPUT_DIR\n";
    return 2;
  }
  try {
    torch::inductor::AOTIModelPackageLoader loader(argv[1]);
    std::vector<at::Tensor> inputs;
    std::ifstream list(argv[2]);
    for (std::string line; std::getline(list, line);) {
      if (!line.empty()) inputs.push_back(read_tensor(line));
    }
    std::vector<at::Tensor> outputs = loader.run(inputs);
    std::ofstream described(std::string(argv[3]) + "/outputs.txt");
    for (size_t i = 0; i < outputs.size(); ++i) write_tensor(outputs[i], argv[3], i, described);
  } catch (const std::exception& err) {
    std::string message = err.what();
    std::cerr << "error: " << message.substr(0, message.find('\n')) << "\n";
    return 1;
  }
  return 0;
}
