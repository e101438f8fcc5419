# The layout's rules, checked at configure time: ragshardd links none of the planning engine's
# planners, unit solver, strategy search or cost model, baselines, model zoo or validator, and
# ragshard-planner links none of the node protocol (command queue, fd passing, unsharded
# views). Each rule looks at the source files of every library the program links, directly or
# through others, so that a file moved into another library is still found.

# The targets `target` links, itself included, following LINK_LIBRARIES and
# INTERFACE_LINK_LIBRARIES (generator expressions and plain file names are skipped).
function(ragshard_linked_targets target out)
  set(seen "")
  set(stack ${target})
  while(stack)
    list(POP_FRONT stack t)
    if(NOT TARGET ${t} OR t IN_LIST seen)
      continue()
    endif()
    get_target_property(aliased ${t} ALIASED_TARGET)
    if(aliased)
      set(t ${aliased})
    endif()
    list(APPEND seen ${t})
    foreach(property LINK_LIBRARIES INTERFACE_LINK_LIBRARIES)
      get_target_property(libs ${t} ${property})
      if(libs)
        foreach(lib ${libs})
          if(NOT lib MATCHES "^\\$<" AND TARGET ${lib})
            list(APPEND stack ${lib})
          endif()
        endforeach()
      endif()
    endforeach()
  endwhile()
  set(${out} ${seen} PARENT_SCOPE)
endfunction()

# Fails the configuration if `program` links a library with one of `forbidden` (file names,
# e.g. planner.cc) among its sources; `why` ends the message.
function(ragshard_forbid_sources program why)
  ragshard_linked_targets(${program} linked)
  foreach(t ${linked})
    get_target_property(type ${t} TYPE)
    if(type STREQUAL "INTERFACE_LIBRARY")
      continue()
    endif()
    get_target_property(sources ${t} SOURCES)
    if(NOT sources)
      continue()
    endif()
    foreach(source ${sources})
      get_filename_component(name ${source} NAME)
      if(name IN_LIST ARGN)
        message(FATAL_ERROR "${program} links ${t}, which builds ${name}: ${why}")
      endif()
    endforeach()
  endforeach()
endfunction()

ragshard_forbid_sources(ragshardd
  "the daemon links infra/, protocol/ and the plan model (ragshard_plan_model) only, not the planning engine"
  planner.cc unit_solver.cc unit_grouping.cc strategy.cc strategy_search.cc strategy_cost.cc
  strategy_model.cc strategy_bound.cc baselines.cc models.cc validator.cc)
ragshard_forbid_sources(ragshard-planner
  "the planner links the planning engine and infra/, not the node protocol (ragshard_protocol)"
  command_queue.cc fd_passing.cc unsharded_view.cc)
