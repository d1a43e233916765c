// magi-workload SCENARIO [options]: the scenarios of libworkload.so, linked the ordinary way
// (so libnccl.so.2 is in the global symbol scope, as in most programs).
extern "C" int magi_workload_main(int argc, char** argv);

int main(int argc, char** argv) { return magi_workload_main(argc - 1, argv + 1); }
