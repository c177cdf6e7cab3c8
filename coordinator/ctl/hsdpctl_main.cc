#include <iostream>

#include "coordinator/ctl/hsdpctl.h"

int main(int argc, char** argv) {
  return hsdp::ctl::RunHsdpctl(argc, argv, std::cout, std::cerr);
}
