#include "launch/cli.h"

int main(int argc, char** argv) { return hp::run_cli(argc, argv); }
