// Forced into every translation unit of the TSan build
// (cmake/sanitizers.cmake).
//
// Why: protobuf 3.21's map_field.h adds two members (seq1_, seq2_) to
// MapFieldBase when __SANITIZE_THREAD__ is defined. Debian's libprotobuf is not
// built with TSan, so code compiled with -fsanitize=thread and the library
// disagree on the layout of every map field: the library's reflection and JSON
// code (and the well-known types it defines, such as google.protobuf.Struct)
// read the members after them at the wrong offsets, and a lookup in a Struct
// parsed by JsonStringToMessage crashes. map_field.h is included here first,
// with the macro hidden, so every TU sees the layout the library was built
// with; its include guard keeps later includes from seeing the other one. The
// members only made const/mutable races on one map field "more apparent" to
// TSan: nothing is lost for hsdp's code.
#pragma push_macro("__SANITIZE_THREAD__")
#undef __SANITIZE_THREAD__
#include <google/protobuf/map_field.h>
#pragma pop_macro("__SANITIZE_THREAD__")
